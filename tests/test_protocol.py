"""The Redis protocol layer: heartbeats (one parser, one liveness rule), NOGROUP translation, and
the rule that library code outside it sends no Redis command itself."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from redis.exceptions import ResponseError
from rollstream.common.errors import ConfigError
from rollstream.common.protocol import Heartbeat, admission_refusals, fold, is_nogroup, live_producers, nogroup_error

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL_MODULES = {"common/lua.py", "common/namespace.py", "common/events.py"}
PROTOCOL_PACKAGE = "common/protocol/"
"""The modules that send Redis commands (the package and these three); everything else goes through them."""
LIBRARY = ("common", "producer", "consumer", "ops", "cli", "integrations")
REDIS_COMMANDS = {
    "xadd", "xack", "xdel", "xlen", "xrange", "xrevrange", "xread", "xreadgroup", "xclaim", "xautoclaim",
    "xpending", "xpending_range", "xinfo_groups", "xinfo_consumers", "xgroup_create", "xgroup_delconsumer",
    "hget", "hset", "hmget", "hgetall", "hincrby", "hsetnx", "publish", "pubsub", "pipeline", "delete",
    "exists", "scan_iter", "register_script",
}


def test_library_code_sends_redis_commands_only_through_the_protocol_layer() -> None:
    offenders = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []:
            relative = path.relative_to(ROOT).as_posix()
            if relative in PROTOCOL_MODULES or relative.startswith(PROTOCOL_PACKAGE):
                continue
            for node in ast.walk(ast.parse(path.read_text(), relative)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in REDIS_COMMANDS
                    and "redis" in ast.unparse(node.func.value).lower()
                ):
                    offenders.append(f"{relative}:{node.lineno}: {ast.unparse(node.func)}")
    assert not offenders, "Redis commands outside common/protocol/:\n" + "\n".join(offenders)


def test_a_heartbeat_round_trips_and_tolerates_old_and_new_fields() -> None:
    beat = Heartbeat(host="h", pid=7, state="running", in_flight_samples=3, engines=["http://e"], last_seen_ms=1000)
    assert Heartbeat.parse(beat.to_json()) == beat
    parsed = Heartbeat.parse(json.dumps({"state": "draining", "last_seen_ms": 5, "future_field": 1, "pid": "x"}))
    assert (parsed.state, parsed.last_seen_ms, parsed.pid) == ("draining", 5, 0)
    for bad in (b"not json", b"[1, 2]"):
        with pytest.raises(ValueError):
            Heartbeat.parse(bad)


def test_one_liveness_rule_a_fresh_heartbeat_of_a_live_state() -> None:
    now, timeout = 100_000, 15.0
    fresh = Heartbeat(state="running", last_seen_ms=now - 14_000)
    assert fresh.alive(now, timeout)
    assert not Heartbeat(state="running", last_seen_ms=now - 16_000).alive(now, timeout)
    assert not Heartbeat(state="stopped", last_seen_ms=now).alive(now, timeout)
    raw = {
        b"a": Heartbeat(state="running", in_flight_samples=4, last_seen_ms=now).to_json().encode(),
        b"b": Heartbeat(state="draining", in_flight_samples=2, last_seen_ms=now).to_json().encode(),
        b"c": Heartbeat(state="failed", in_flight_samples=9, last_seen_ms=now).to_json().encode(),
        b"d": b"garbage",
    }
    assert live_producers(raw, now, timeout) == (2, 6)


def test_nogroup_becomes_a_config_error_naming_the_namespace() -> None:
    assert isinstance(nogroup_error("ns-1", ResponseError("NOGROUP No such key")), ConfigError)
    assert "namespace 'ns-1'" in str(nogroup_error("ns-1", ResponseError("NOGROUP No such key")))
    assert is_nogroup(ResponseError("NOGROUP No such key or consumer group"))
    assert is_nogroup(ResponseError("Error running script (call to f_1): @user_script:3: NOGROUP No such key"))
    assert not is_nogroup(ResponseError("WRONGTYPE Operation against a key"))


@dataclasses.dataclass(slots=True)
class _NewerHeartbeat(Heartbeat):
    """A heartbeat with fields added the one way the model allows: typed fields of the dataclass."""

    gpu_busy: float = 0.0
    queued_jobs: int = 0
    zone: str = ""
    models: list[str] = dataclasses.field(default_factory=list)


def test_a_new_heartbeat_field_is_one_edit_and_round_trips() -> None:
    beat = _NewerHeartbeat(state="running", pid=3, gpu_busy=0.5, queued_jobs=4, zone="eu", models=["m"])
    assert _NewerHeartbeat.parse(beat.to_json()) == beat
    assert _NewerHeartbeat.damage(json.dumps({"queued_jobs": "four", "zone": 7})) == (
        "fields queued_jobs, zone have the wrong type"
    )
    older = _NewerHeartbeat.parse(Heartbeat(state="running", pid=3).to_json())  # an older producer's
    assert (older.pid, older.queued_jobs, older.zone) == (3, 0, "")
    assert Heartbeat.parse(beat.to_json()) == Heartbeat(state="running", pid=3)  # read by an older one


def test_heartbeats_are_folded_once_for_every_question() -> None:
    now, timeout = 100_000, 15.0
    raw = {
        b"a": Heartbeat(state="running", in_flight_samples=4, last_seen_ms=now, admission="backlog",
                        admission_since_ms=now - 3000).to_json().encode(),
        b"b": Heartbeat(state="running", in_flight_samples=1, last_seen_ms=now - 20_000).to_json().encode(),
        b"c": b"{broken",
    }
    fleet = fold(raw, now, timeout)
    assert fleet.alive_names == ["a"] and fleet.in_flight == 4 and fleet.refusals == {"backlog": 3.0}
    assert [(m.name, m.fresh, m.error != "") for m in fleet.members] == [("a", True, False), ("b", False, False),
                                                                         ("c", False, True)]
    assert live_producers(raw, now, timeout) == (1, 4) and admission_refusals(raw, now, timeout) == fleet.refusals


KEPT_FOR_CONSUMER = {"read_heartbeats"}
"""Free functions of the protocol package that take a raw client, kept importable until
``consumer/`` reads through the bound classes (then delete them here and there)."""
CONSUMER_OWNED = {"common/protocol/trainer.py"}


def test_every_protocol_operation_is_a_method_of_a_bound_class() -> None:
    """No public function of the protocol package takes a Redis client: each operation is a method
    of a class bound to (client, namespace), so no caller hands a raw client around."""
    offenders = []
    for path in sorted((ROOT / PROTOCOL_PACKAGE).glob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in CONSUMER_OWNED:
            continue
        for node in ast.parse(path.read_text(), relative).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                names = [a.arg for a in node.args.args]
                if names and names[0] == "redis" and node.name not in KEPT_FOR_CONSUMER:
                    offenders.append(f"{relative}:{node.lineno}: {node.name}({', '.join(names)})")
    assert not offenders, "free functions taking a client:\n" + "\n".join(offenders)
    assert all("redis" not in inspect.signature(fn).parameters for fn in (fold, live_producers, admission_refusals))
