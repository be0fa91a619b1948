"""What the installed package imports is what pyproject.toml installs (issue 50): a package only
tests or benchmarks need lives in the ``dev`` extra, and no module of the package imports it, so
``pip install rollstream`` runs everything a trainer and a producer do (one HTTP client stack:
aiohttp, plus the engine path's own HTTP/1.1 on httptools; docs/decisions.md)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from test_layers import ROOT, imported, library_files, module_name

DEV_ONLY_ALLOWED = {
    ("rollstream.producer.engine.transport", "httpx"): "HttpxTransport, imported only when a caller "
    "passes an httpx transport (tests' httpx.MockTransport): the caller has httpx then",
}
"""(module, dev-only package) imports allowed in the package, each with the reason."""


def _import_name(requirement: str) -> str:
    """``fakeredis[lua]>=2.23`` -> ``fakeredis``; ``prometheus-client`` -> ``prometheus_client``."""
    name = re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0]
    return name.lower().replace("-", "_")


def declared() -> tuple[set[str], set[str]]:
    """(import names of the base dependencies and every extra but dev, of the dev-only ones)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {_import_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    for name, requirements in extras.items():
        if name != "dev":
            installed |= {_import_name(r) for r in requirements}
    dev = {_import_name(r) for r in extras["dev"]} - installed
    return installed, dev


def dev_only_imports(root: Path = ROOT) -> list[str]:
    _, dev = declared()
    found = []
    for package, path in library_files(root):
        folder = root / path.relative_to(root).parts[0]
        module = module_name(package, path, folder)
        for line, target in imported(path, module):
            top = target.partition(".")[0]
            if top in dev and (module, top) not in DEV_ONLY_ALLOWED:
                found.append(f"{path.relative_to(root).as_posix()}:{line} imports {target} (dev only)")
    return found


def test_the_package_imports_no_dev_only_dependency() -> None:
    found = dev_only_imports()
    assert not found, "the package imports what only the dev extra installs:\n" + "\n".join(found)


def test_the_base_install_has_one_http_client_stack() -> None:
    """httpx (with httpcore, anyio, h11, sniffio) is for tests and benchmarks only: the cold paths
    (weight sync, the remote reward, the demo) use aiohttp's client, already there for aiohttp.web."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_import_name(r) for r in project["dependencies"]}
    assert base == {"redis", "hiredis", "msgspec", "msgpack", "aiohttp", "httptools"}
    _, dev = declared()
    assert {"httpx", "sniffio"} <= dev


def test_the_checker_catches_a_dev_only_import(tmp_path: Path) -> None:
    (tmp_path / "weight_sync").mkdir()
    (tmp_path / "weight_sync" / "__init__.py").write_text("import httpx\nfrom fakeredis import FakeRedis\n")
    assert dev_only_imports(tmp_path) == [
        "weight_sync/__init__.py:1 imports httpx (dev only)",
        "weight_sync/__init__.py:2 imports fakeredis (dev only)",
    ]


def test_starting_the_cli_imports_no_http_library() -> None:
    """Every ``rollstream`` process (a producer, a feeder, ``inspect``) starts by importing the CLI:
    aiohttp's client costs a fifth of that start's CPU (0.88 against 1.12 s here), so the cold
    paths import it when they first call, and httpx is not imported at all."""
    import subprocess
    import sys

    code = "import sys, rollstream.cli.main; print(sorted(m for m in ('aiohttp', 'httpx') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"
