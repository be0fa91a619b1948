"""The import rules of docs/architecture.md, read from the source (ast), so a wrong-way import
fails the suite instead of slowly tangling the packages.

Layers, top to bottom: cli -> integrations / ops / testing -> producer, consumer, weight_sync -> runtime
-> common. An import may only point down (or stay inside its own package); producer and consumer
never import each other; library code never imports ``testing`` (the CLI's ``sim-engine`` and
``demo`` may: they serve the simulator); Redis key names are spelled only in ``common/keys.py``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import itertools
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "package": "rollstream",
    "common": "rollstream.common",
    "producer": "rollstream.producer",
    "consumer": "rollstream.consumer",
    "ops": "rollstream.ops",
    "integrations": "rollstream.integrations",
    "weight_sync": "rollstream.weight_sync",
    "testing": "rollstream.testing",
    "runtime": "rollstream.runtime",
    "cli": "rollstream.cli",
}
ALLOWED = {
    "rollstream": set(),  # imported first by every subpackage: it must stay light
    "common": {"common"},
    "runtime": {"runtime", "common"},  # the embedded Redis, the supervisor, parent-death watching
    "producer": {"producer", "common"},
    "consumer": {"consumer", "common"},
    "weight_sync": {"weight_sync", "common"},
    "ops": {"ops", "producer", "consumer", "common"},
    "integrations": {"integrations", "runtime", "producer", "consumer", "common"},
    "testing": {"testing", "runtime", "producer", "consumer", "weight_sync", "common"},
    "cli": {"cli", "ops", "integrations", "testing", "runtime", "producer", "consumer", "weight_sync", "common",
            "rollstream"},
}
HAND_BUILT_KEY = re.compile(r"\}:|:\{")
KEY_LITERAL = re.compile(r"rollstream:(?! )")  # "rollstream: error: ..." is a message, not a key


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for all the checks of a run (they only read it)."""
    return ast.parse(path.read_text(), str(path))


def library_files(root: Path = ROOT) -> Iterator[tuple[str, Path]]:
    for folder, package in FOLDERS.items():
        base = root / folder
        if base.is_dir():
            for path in sorted(base.rglob("*.py")):
                yield package, path


def module_name(package: str, path: Path, folder: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative ones resolved."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield node.lineno, target
            if not node.module or node.module == "rollstream":  # `from rollstream import ops`
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}"


def layer(name: str) -> str | None:
    """The layer of a rollstream module name (None for third-party and stdlib)."""
    parts = name.split(".")
    if parts[0] != "rollstream":
        return None
    if len(parts) == 1 or parts[1] == "__version__":
        return "rollstream"
    return parts[1] if parts[1] in ALLOWED else "rollstream"


def type_checking_lines(path: Path) -> set[int]:
    """The lines of ``if TYPE_CHECKING:`` blocks (imports type checkers see, never run)."""
    lines: set[int] = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def violations() -> Iterator[str]:
    for package, path in library_files():
        folder = ROOT / path.relative_to(ROOT).parts[0]
        module = module_name(package, path, folder)
        own = layer(module)
        assert own is not None
        # the top package's exports are imported lazily (its __getattr__): only type checkers read them
        typing_only = type_checking_lines(path) if own == "rollstream" else set()
        for line, target in imported(path, module):
            if line in typing_only:
                continue
            other = layer(target)
            if other is not None and other != own and other not in ALLOWED[own]:
                yield f"{path.relative_to(ROOT)}:{line}: {own} must not import {target}"


def key_spellings(root: Path = ROOT) -> Iterator[str]:
    for _, path in library_files(root):
        if path == root / "common" / "keys.py":
            continue
        tree = parsed(path)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }
        relative = path.relative_to(root)  # once a file: per node it was most of the test's time
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if KEY_LITERAL.search(node.value):
                    yield f"{relative}:{node.lineno}: Redis key literal {node.value[:60]!r}"
            elif isinstance(node, ast.JoinedStr):
                literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
                if HAND_BUILT_KEY.search(literal) or KEY_LITERAL.search(literal):
                    yield f"{relative}:{node.lineno}: hand-built key name in an f-string ({literal[:60]!r})"
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("keys"):
                if any(alias.name == "PREFIX" for alias in node.names):
                    yield f"{relative}:{node.lineno}: builds key names from PREFIX; use common.keys.Keys"


def test_imports_point_down() -> None:
    found = list(violations())
    assert not found, "forbidden imports:\n" + "\n".join(found)


LIBRARY = ("common", "runtime", "producer", "consumer", "weight_sync", "ops", "integrations")
"""What a trainer or a producer runs: none of it may import ``rollstream.testing`` (the simulator,
sample factories, the tiny model), so an install without the test extras runs everything."""


def test_library_code_never_imports_testing() -> None:
    assert all("testing" not in ALLOWED[name] for name in LIBRARY)
    found = [v for v in violations() if "must not import rollstream.testing" in v]
    assert not found, "library code importing rollstream.testing:\n" + "\n".join(found)


def test_the_rule_checker_catches_library_code_importing_testing(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("from rollstream.testing.sim import serve\n")
    assert [layer(target) for _, target in imported(path, "rollstream.integrations.bad")] == ["testing"]
    assert "testing" not in ALLOWED["integrations"]


def test_the_top_package_exports_the_user_facing_types_lazily() -> None:
    """``from rollstream import Episode, GroupConsumer, Sample``: every export resolves to the
    object its module defines, the ``TYPE_CHECKING`` imports name the same ones, and importing
    ``rollstream`` (which every subpackage does first) imports no subpackage."""
    import subprocess
    import sys

    import rollstream

    init = ROOT / "package" / "__init__.py"
    typing_only = type_checking_lines(init)
    seen = {
        alias.name: node.module
        for node in ast.walk(parsed(init))
        if isinstance(node, ast.ImportFrom) and node.lineno in typing_only
        for alias in node.names
    }
    assert seen == rollstream._EXPORTS
    assert sorted(rollstream.__all__) == sorted([*rollstream._EXPORTS, "__version__"])
    for name, module in rollstream._EXPORTS.items():
        assert getattr(rollstream, name) is getattr(importlib.import_module(module), name), name
    code = "import sys, rollstream; print(sorted(m for m in sys.modules if m.startswith('rollstream.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert loaded.stdout.strip() == "[]"
    with pytest.raises(AttributeError):
        rollstream.NoSuchThing  # noqa: B018


SAME_NAME_ALLOWED = {
    # producer/engine/ is being reworked (issue 31, the dialects) and may not be edited meanwhile;
    # producer/settings.py (per process) and producer/engine/settings.py (per engine) both stay
    "settings": {"producer/settings.py", "producer/engine/settings.py"},
}
"""Module names two library modules share on purpose, with the modules (nothing else may join)."""


def module_names(root: Path = ROOT) -> dict[str, list[str]]:
    """Each library module's own name (a package's is its folder's, the top ones their installed
    name) -> the files that carry it."""
    names: dict[str, list[str]] = {}
    for package, path in library_files(root):
        folder = root / path.relative_to(root).parts[0]
        name = module_name(package, path, folder).rsplit(".", 1)[-1]
        if name != "__main__":
            names.setdefault(name, []).append(path.relative_to(root).as_posix())
    return names


def same_names(root: Path = ROOT) -> list[str]:
    return [
        f"{name}: {', '.join(paths)}" for name, paths in sorted(module_names(root).items())
        if len(paths) > 1 and set(paths) != SAME_NAME_ALLOWED.get(name)
    ]


def test_one_module_name_per_meaning() -> None:
    """Two library modules never share a name (``health``, ``control``, ``views`` meant two things
    each), so a name says where you are; the exceptions are listed, with the reason."""
    found = same_names()
    assert not found, "library modules sharing a name (rename one, docs/architecture.md):\n" + "\n".join(found)


def test_the_name_checker_catches_two_modules_of_one_name(tmp_path: Path) -> None:
    for folder in ("common", "ops"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "health.py").write_text("")
    (tmp_path / "common" / "ops").mkdir()  # a package named like a top one counts too
    (tmp_path / "common" / "ops" / "__init__.py").write_text("")
    assert same_names(tmp_path) == ["health: common/health.py, ops/health.py", "ops: common/ops/__init__.py, ops/__init__.py"]


def reexport_shims(root: Path = ROOT) -> list[str]:
    """``from m import X as X`` / ``import m as m`` in a library module: a name kept where it no
    longer lives (callers should import it from its defining module)."""
    return [
        f"{path.relative_to(root).as_posix()}:{node.lineno} {alias.name}"
        for _, path in library_files(root)
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
        if alias.asname is not None and alias.asname == alias.name.rsplit(".", 1)[-1]
    ]


def test_no_reexport_shims() -> None:
    found = reexport_shims()
    assert not found, "`import X as X` re-export shims (import from the defining module):\n" + "\n".join(found)


def test_the_shim_checker_catches_one(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    (tmp_path / "common" / "a.py").write_text("from common.errors import Boom as Boom\nimport json as js\n")
    assert reexport_shims(tmp_path) == ["common/a.py:1 Boom"]


def test_redis_key_names_only_in_the_keys_module() -> None:
    found = list(key_spellings())
    assert not found, "key names spelled outside common/keys.py:\n" + "\n".join(found)


def test_the_key_checker_catches_a_hand_built_key(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "bad.py").write_text('KEY = f"{PREFIX}:{{{ns}}}:prompts"\nOTHER = "rollstream:{x}:dead"\n')
    found = list(key_spellings(tmp_path))
    assert len(found) == 2, found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from rollstream.cli.main import main\n", "common must not import rollstream.cli.main"),
        ("from ..consumer import GroupConsumer\n", "common must not import rollstream.consumer"),
    ],
)
def test_the_rule_checker_catches_a_wrong_way_import(tmp_path: Path, source: str, expected: str) -> None:
    path = tmp_path / "bad.py"
    path.write_text(source)
    found = [
        f"common must not import {target}"
        for _, target in imported(path, "rollstream.common.bad")
        if layer(target) not in (None, "common")
    ]
    assert expected in found


def test_every_package_directory_is_listed_for_the_wheel() -> None:
    """setuptools' static ``packages`` list must name every folder with an ``__init__.py`` under the
    mapped package directories, or a wheel install silently lacks it (it happened to two splits)."""
    root = Path(__file__).resolve().parent.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    found = set()
    for name, folder in setup["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *parts)))
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"


def test_mypy_reads_every_mapped_package_under_its_installed_name() -> None:
    """mypy checks ``scripts/typecheck/rollstream`` (symlinks laid out as installed): a package-dir
    folder missing there would go unchecked, and its ``rollstream.x`` imports would read as Any."""
    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]
    tree = root / "scripts" / "typecheck"
    assert config["mypy"]["files"] == ["scripts/typecheck/rollstream"]
    wrong = []
    for name, folder in config["setuptools"]["package-dir"].items():
        link = tree.joinpath(*name.split("."))
        target = link / "__init__.py" if name == "rollstream" else link
        real = root / folder / "__init__.py" if name == "rollstream" else root / folder
        if not (target.is_symlink() and target.resolve() == real.resolve()):
            wrong.append(f"{link.relative_to(root)} -> {folder}")
    assert not wrong, f"scripts/typecheck lacks (or misroutes) {wrong}"


PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
"""NamedTuple's public API (its names start with ``_`` so fields cannot clash)."""


def private_reaches(root: Path = ROOT, folders: tuple[str, ...] = ("producer",)) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is not defined in the same
    module: code reaching into another module's object's private members (issue 50: the drain and
    the reclaim pass reached into about 20 of the worker's)."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = parsed(path)
            own: set[str] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    own.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    own.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    own.add(node.id)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    own.add(node.value)  # __slots__ = ("_count", ...)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in PUBLIC_UNDERSCORE and node.attr not in own
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                ):
                    found.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_producer_module_reaches_into_another_modules_private_members() -> None:
    """The producer's work in flight has one owner (``capacity.WorkTable``), shared through its
    methods; a module reading another's ``_members`` is how the state lost its owner before."""
    found = private_reaches()
    assert not found, "private members reached across modules (add a method to the owner):\n" + "\n".join(found)


def test_the_private_member_checker_catches_a_reach(tmp_path: Path) -> None:
    (tmp_path / "producer").mkdir()
    (tmp_path / "producer" / "drain.py").write_text(
        "def shutdown(p):\n    p._work.clear()\n    p.table.stop()\n    return p.row._replace(a=1)\n"
    )
    (tmp_path / "producer" / "own.py").write_text(
        "class A:\n    __slots__ = ('_n',)\n    def __init__(self):\n        self._n = 0\n"
        "def bump(a: A) -> None:\n    a._n += 1\n"
    )
    assert private_reaches(tmp_path) == ["producer/drain.py:2 p._work"]


def test_nothing_in_the_producer_imports_the_worker_back() -> None:
    """The worker composes the drain, the reclaim pass and the heartbeat; they read it through
    a Protocol of its public members, so no import (not even a typing one) points back up."""
    back = [
        f"{path.relative_to(ROOT).as_posix()}:{line}"
        for path in sorted((ROOT / "producer").rglob("*.py")) if path.name not in ("worker.py", "__init__.py")
        for line, target in imported(path, module_name("rollstream.producer", path, ROOT / "producer"))
        if target == "rollstream.producer.worker"
    ]
    assert not back, f"producer modules importing the worker: {back}"


def stacked_docstrings(root: Path = ROOT) -> list[str]:
    """Two string statements in a row in library code: the second is an attribute's docstring
    left under the wrong attribute (an assignment moved, its docstring stayed)."""
    def is_text(node: ast.stmt) -> bool:
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    found = []
    for _, path in library_files(root):
        for node in ast.walk(parsed(path)):
            body = getattr(node, "body", None)
            if isinstance(body, list):
                found += [
                    f"{path.relative_to(root).as_posix()}:{second.lineno}"
                    for first, second in itertools.pairwise(body) if is_text(first) and is_text(second)
                ]
    return found


def test_every_attribute_docstring_sits_under_its_attribute() -> None:
    found = stacked_docstrings()
    assert not found, "a docstring under another docstring (move it under its attribute):\n" + "\n".join(found)


def test_the_docstring_checker_catches_a_stacked_one(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.py").write_text('A = 1\nB = 2\n"""What A is."""\n"""What B is."""\n')
    assert stacked_docstrings(tmp_path) == ["common/a.py:4"]


def hand_checked_ints(root: Path = ROOT) -> list[str]:
    """``isinstance(x, bool)`` beside ``isinstance(x, int...)`` in one condition: "an int that is
    not a bool" written by hand (``common.checked.is_int`` / ``is_number`` say it once)."""
    found = []
    for _, path in library_files(root):
        if path.name == "checked.py":
            continue
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.BoolOp):
                continue
            kinds: dict[str, set[str]] = {}
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "isinstance"
                    and len(call.args) == 2
                ):
                    kinds.setdefault(ast.unparse(call.args[0]), set()).add(ast.unparse(call.args[1]))
            if any("bool" in types and any("int" in t.split(" | ") for t in types) for types in kinds.values()):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return sorted(set(found))


def test_an_int_that_is_not_a_bool_is_checked_in_one_place() -> None:
    found = hand_checked_ints()
    assert not found, "hand-written int-not-bool checks (use rollstream.common.checked):\n" + "\n".join(found)


def test_the_int_checker_catches_a_hand_written_one(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "a.py").write_text(
        "def f(x, y):\n    if isinstance(x, bool) or not isinstance(x, int | float):\n        pass\n"
        "    return (\n        isinstance(y, int)\n        and not isinstance(y, bool)\n    )\n"
    )
    assert hand_checked_ints(tmp_path) == ["common/a.py:2", "common/a.py:5"]


def test_is_int_refuses_a_bool_and_is_number_too() -> None:
    from rollstream.common.checked import is_int, is_number

    assert is_int(3) and is_int(-1) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_number(2.5) and is_number(2) and not is_number(False) and not is_number(None)
