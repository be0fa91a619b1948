"""The Redis protocol layer: heartbeats (one parser, one liveness rule), NOGROUP translation, and
the rule that library code outside it sends no Redis command itself."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

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




def test_every_protocol_operation_is_a_method_of_a_bound_class() -> None:
    """No public function of the protocol package takes a Redis client: each operation is a method
    of a class bound to (client, namespace), so no caller hands a raw client around."""
    offenders = []
    for path in sorted((ROOT / PROTOCOL_PACKAGE).glob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.parse(path.read_text(), relative).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                names = [a.arg for a in node.args.args]
                if names and names[0] == "redis":
                    offenders.append(f"{relative}:{node.lineno}: {node.name}({', '.join(names)})")
    assert not offenders, "free functions taking a client:\n" + "\n".join(offenders)
    assert all("redis" not in inspect.signature(fn).parameters for fn in (fold, live_producers, admission_refusals))


# -- docs/architecture.md's "where a change goes" ------------------------------------------

CHANGES = (
    "a new metric", "a new heartbeat field", "a new engine API", "a new Redis script", "a new reward scheme",
    "a new producer option", "a new rollout plug-in", "a new sample field",
)
_PATH = re.compile(r"`([A-Za-z0-9_./<>-]+(?:\.py|\.md|\.template|/))`")


def _change_table() -> dict[str, str]:
    """Change -> its text (the list under its ``#### <change>`` heading of "## Where a change goes")."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where a change goes", 1)[1].split("\n## ", 1)[0]
    out = {}
    for part in section.split("\n#### ")[1:]:
        change, _, body = part.partition("\n")
        out[change.strip()] = "\n".join(line for line in body.splitlines() if line.startswith(("- ", "  ")))
    return out


def _named_paths(row: str) -> list[str]:
    return [m for m in _PATH.findall(row) if "/" in m or m.endswith(".py")]


def _library_modules() -> dict[str, ast.Module]:
    out = {}
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else []:
            out[path.relative_to(ROOT).as_posix()] = ast.parse(path.read_text())
    return out


_CODE = re.compile(r"`([^`]+)`")
_NAME = re.compile(r"^(?:self\.)?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*\))?$")


def _row_namespaces(row: str) -> tuple[list[Any], dict[str, set[str]]]:
    """The library modules a row names (``<api>`` standing for every file it matches), and the
    top-level names of the test files it names (read, not imported)."""
    modules: list[Any] = []
    tests: dict[str, set[str]] = {}
    test_files = [f"tests/{code.partition('::')[0]}" for code in _CODE.findall(row) if code.partition("::")[0]]
    for named in [*_named_paths(row), *test_files]:
        for path in ROOT.glob(re.sub(r"<[^>]+>", "*", named)):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith("tests/") and path.suffix == ".py":
                tree = ast.parse(path.read_text())
                tests[path.name] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                tests[path.name] |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                                     if isinstance(t, ast.Name)}
            elif path.suffix == ".py" and relative.split("/")[0] in (*LIBRARY, "testing", "weight_sync"):
                parts = path.with_suffix("").relative_to(ROOT).parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                modules.append(importlib.import_module(".".join(("rollstream", *parts))))
    return modules, tests


def _resolves(name: str, modules: list[Any]) -> bool:
    """``name`` is a module-level name of one of ``modules`` (``mod.attr``: of the module named
    ``mod``), an attribute of a class they hold (a method, a dataclass field), a builtin or an
    importable module."""
    first, *rest = name.split(".")
    for module in modules:
        if rest and module.__name__.rsplit(".", 1)[-1] == first and _getattr_chain(module, rest) is not None:
            return True
        if not rest and hasattr(module, first):
            return True
    last = name.rsplit(".", 1)[-1]
    classes = [v for m in modules for v in vars(m).values() if isinstance(v, type)]
    if any(hasattr(c, last) or last in getattr(c, "__dataclass_fields__", {}) for c in classes):
        return True
    if not rest and hasattr(builtins, first):
        return True
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def _getattr_chain(obj: Any, parts: list[str]) -> Any:
    for part in parts:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def test_every_name_where_a_change_goes_names_exists() -> None:
    """Every function, class or constant a row names is where the row says (in a file the row
    names, or a class of one), and every test it names exists: a moved function fails here."""
    missing = []
    for change, row in _change_table().items():
        modules, tests = _row_namespaces(row)
        test_file = None
        for code in _CODE.findall(row):
            if "::" in code:
                file, _, test = code.partition("::")
                test_file = file or test_file
                if test_file not in tests or test not in tests[test_file]:
                    missing.append(f"{change}: {code}")
                continue
            match = _NAME.match(code)
            if match is None or "/" in code or code.endswith((".py", ".md")):
                continue  # a path, a flag, a spec: not a name
            name = match.group(1)
            if not _resolves(name, modules) and not any(name in names for names in tests.values()):
                missing.append(f"{change}: {code}")
    assert not missing, "names in docs/architecture.md's 'where a change goes' that are not there:\n" + "\n".join(missing)


def test_where_a_change_goes() -> None:
    """Each row of the table names files that exist and states a rule the code keeps."""
    table = _change_table()
    assert tuple(table) == CHANGES
    missing = []
    for change, row in table.items():
        paths = _named_paths(row)
        assert paths, f"{change}: the row names no file"
        for named in paths:
            if not list(ROOT.glob(re.sub(r"<[^>]+>", "*", named).rstrip("/"))):
                missing.append(f"{change}: {named}")
    assert not missing, "the table names files that do not exist:\n" + "\n".join(missing)
    modules = _library_modules()
    # A new Redis script: only common/lua.py and the protocol package (which binds them) run scripts.
    outside = [
        f"{relative}:{node.lineno}" for relative, tree in modules.items()
        if relative != "common/lua.py" and not relative.startswith(PROTOCOL_PACKAGE)
        for node in ast.walk(tree)
        if (isinstance(node, ast.ImportFrom) and ((node.module or "").endswith("lua")
                                                  or any(alias.name == "lua" for alias in node.names))) or (
            isinstance(node, ast.Attribute) and node.attr in ("register_script", "evalsha", "eval"))
    ]
    assert not outside, f"scripts run outside the protocol package: {outside}"
    # A new heartbeat field: the producer reports every field (a field nobody writes is dead).
    calls = [node for node in ast.walk(modules["producer/pulse.py"])
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Heartbeat"]
    assert len(calls) == 1, "the producer builds its heartbeat in one place"
    given = {kw.arg for kw in calls[0].keywords}
    assert given == {f.name for f in dataclasses.fields(Heartbeat)}, "a heartbeat field the producer does not set"
    # A new reward scheme, a new rollout plug-in: one registry each, the frameworks' registered on import.
    import rollstream.integrations  # noqa: F401  (registers the framework schemes)
    from rollstream.integrations import framework_rewards, generate
    from rollstream.producer.plugin import generate_schemes
    from rollstream.producer.rewards.loader import schemes

    assert {"math", "remote", *framework_rewards.SCHEMES} <= set(schemes())
    assert set(generate.SCHEMES) <= set(generate_schemes())


def test_docs_prose_lines_are_wrapped() -> None:
    """No line of README.md or docs/*.md over 200 characters outside tables and code blocks
    (a paragraph is wrapped, a table of prose is a list)."""
    long = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fence = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            fence ^= line.startswith("```")
            if len(line) > 200 and not fence and not line.startswith("|"):
                long.append(f"{path.relative_to(ROOT)}:{number}: {len(line)} characters")
    assert not long, "wrap these lines:\n" + "\n".join(long)
