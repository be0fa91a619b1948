"""Every dotted name and repository path the docs mention exists (README.md, docs/*.md): a moved
module, a renamed class or a deleted test fails here instead of leaving the docs untrue.

Checked, in backticks: ``rollstream.<...>`` names and names starting with a subpackage
(``common.keys.Keys``, ``producer.rewards.RewardBroken``): imported, the rest read as attributes;
paths under a top folder of the repository (``producer/engine/http11.py``, ``tests/test_x.py``,
``deploy/...``; ``<api>`` stands for any name): they exist, and ``file.py::test_name`` names a
function of that file. Anything else in backticks (flags, code, field names) is not a name."""

from __future__ import annotations

import ast
import importlib
import re

from test_layers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("bench", "cli", "common", "consumer", "deploy", "docs", "examples", "integrations", "ops", "package",
       "producer", "runtime", "scripts", "testing", "tests", "weight_sync")
SUBPACKAGES = ("common", "producer", "consumer", "ops", "cli", "integrations", "testing", "runtime", "weight_sync")
NOT_THERE_ON_PURPOSE = {
    "bench/out/": "written by the benchmarks when they run",
    "deploy/secrets/": "created by the operator (docs/deploy.md)",
    "producer/engine.py": "benchmarks.md's history: the engine client before it became a package",
    "bench/learning_staleness.py": "benchmarks.md's history: a measurement since replaced",
    "producer.episodes": "a group title of `rollstream produce --help`, not a module",
}
"""Names the docs mention that are not in the repository, each with the reason."""
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
PATH = re.compile(r"^[\w.<>*-]+(?:/[\w.<>*{}-]*)+(?:::\w+)?$")


def _attribute(target: str) -> bool:
    """``a.b.c``: the longest importable module prefix, then attributes (a dataclass field or a
    name assigned in the module's source counts: class attributes, instance fields)."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if hasattr(obj, name) or name in getattr(obj, "__dataclass_fields__", {}):
                obj = getattr(obj, name, None)
                continue
            return name in _assigned(obj)
        return True
    return False


def _assigned(obj: object) -> set[str]:
    """``self.name = ...`` / annotated names in a class's source (instance attributes)."""
    import inspect

    try:
        tree = ast.parse(inspect.getsource(obj))  # type: ignore[arg-type]
    except (TypeError, OSError):
        return set()
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    return names | {n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _path(code: str) -> str | None:
    """What is wrong with a path the docs name, or None."""
    path, _, test = code.partition("::")
    pattern = re.sub(r"<[^>]+>|\{[^}]+\}", "*", path).rstrip("/")
    found = [p for p in ROOT.glob(pattern)] if pattern else []
    if not found:
        return "no such file"
    if test:
        names = {n.name for p in found if p.suffix == ".py" for n in ast.parse(p.read_text()).body
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        if test not in names:
            return f"no test {test}"
    return None


def check(text: str) -> list[tuple[int, str, str]]:
    """(line, name, what is wrong) for each name or path of ``text`` that is not there."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for code in CODE.findall(line):
            code = code.strip().rstrip(".,;:")
            if any(code.startswith(name) for name in NOT_THERE_ON_PURPOSE):
                continue
            if PATH.match(code) and code.split("/", 1)[0] in TOP:
                wrong = _path(code)
                if wrong:
                    found.append((number, code, wrong))
            elif DOTTED.match(code) and code.split(".", 1)[0] in ("rollstream", *SUBPACKAGES):
                if not _attribute(code if code.startswith("rollstream") else f"rollstream.{code}"):
                    found.append((number, code, "not found"))
    return found


def test_every_name_and_path_the_docs_mention_exists() -> None:
    found = [
        f"{doc.relative_to(ROOT)}:{number}: `{code}`: {wrong}"
        for doc in DOCS for number, code, wrong in check(doc.read_text())
    ]
    assert not found, "the docs name what is not there (fix the docs or the name):\n" + "\n".join(found)


def test_the_checker_finds_a_missing_name_and_path() -> None:
    text = ("`rollstream.common.keys.Keys` and `common.keys.NoSuch`, `producer/engine/http11.py`,\n"
            "`producer/nowhere.py`, `tests/test_layers.py::test_imports_point_down`, "
            "`tests/test_layers.py::test_gone`, `--flag`, `x.y`, `producer/engine/<api>.py`\n")
    assert [code for _, code, _ in check(text)] == [
        "common.keys.NoSuch", "producer/nowhere.py", "tests/test_layers.py::test_gone",
    ]
