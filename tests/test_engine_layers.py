"""The engine client's walls (docs/architecture.md, "where a change goes"): HTTP libraries only in
the transport, an engine API is one dialect module named in ``dialects.py`` (its endpoints and
parsers included), weight versions parsed by one function."""

from __future__ import annotations

import ast
from pathlib import Path

from rollstream.producer.engine import ENGINE_APIS, EngineSettings
from rollstream.producer.engine.dialects import DIALECTS

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "producer" / "engine"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


TRANSPORT = {"transport.py", "http11.py"}
"""The transport layer: the contract and its default HTTP/1.1 implementation."""


def test_http_libraries_are_imported_only_by_the_transport() -> None:
    offenders = [
        path.name for path in sorted(ENGINE.glob("*.py"))
        if path.name not in TRANSPORT and _imports(path) & {"aiohttp", "httpx", "httpx_aiohttp", "ssl", "socket"}
    ]
    assert offenders == [], f"HTTP belongs in producer/engine/transport.py or http11.py, not {offenders}"
    sockets = [
        path.name for path in sorted(ENGINE.glob("*.py"))
        if path.name not in TRANSPORT and "create_connection" in path.read_text()
    ]
    assert sockets == [], f"connections are opened by the transport only, not {sockets}"


CONTRACT = ("name", "batches_samples", "accepts_messages", "needs_token_ids", "needs_model", "replies_carry_versions",
            "routing_replay", "seed_reschedule_kills", "version_paths", "version_hint", "loads", "abort", "weights")


def test_every_engine_api_is_a_dialect_with_the_whole_contract() -> None:
    assert ENGINE_APIS == tuple(DIALECTS)
    for name, dialect in DIALECTS.items():
        for attribute in CONTRACT:
            assert hasattr(dialect, attribute), (name, attribute)
        assert dialect.name == name
        assert callable(dialect.encode) and callable(dialect.decode) and dialect.version_paths, name
        assert dialect.version_hint and dialect.loads and dialect.abort.path.startswith("/"), name
        assert dialect.weights.catch_up_requests("/w", 3), name
        EngineSettings(urls=("http://e",), api=name, model="m")  # each API is a valid setting


DIALECT_MODULES = {"sglang.py", "openai.py", "vllm.py"}
SHARED_PATHS = {"/health", "/tokenize", "/workers", "/metrics"}
"""Endpoints every API's servers answer alike (health probes, tokenizing, gateway workers, Prometheus)."""


def test_an_engine_api_is_declared_in_its_dialect_module_only() -> None:
    """An API's endpoints (versions, load, abort, generation) are literals of its dialect module, and
    no other module keys a table by API name: discovery, load and the client read the dialect."""
    paths, tables = [], []
    for path in sorted(ENGINE.glob("*.py")):
        if path.name in DIALECT_MODULES or path.name == "dialects.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("/") \
                    and " " not in node.value and len(node.value) > 1 and node.value not in SHARED_PATHS:
                paths.append((path.name, node.value))
            if isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value in DIALECTS for k in node.keys
            ):
                tables.append((path.name, node.lineno))
    assert paths == [], f"an API's endpoints belong in its dialect module, not {paths}"
    assert tables == [], f"a table keyed by engine API is a second declaration: {tables}"


def test_dialects_only_translate() -> None:
    """A dialect writes a request and reads a reply: it imports nothing of the client (it never
    sends, retries or blames); the client alone does."""
    for name in ("sglang.py", "openai.py", "vllm.py", "vllm_replay.py", "parse.py", "types.py", "dialects.py"):
        tree = ast.parse((ENGINE / name).read_text())
        relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
        assert not relative & {"client", "fleet", "monitor", "weights", "transport", "http11", "discovery"}, (name, relative)


def test_a_dialect_encodes_and_decodes_without_a_client() -> None:
    from rollstream.producer.engine.types import Request

    dialect = DIALECTS["sglang"]
    settings = EngineSettings(urls=("http://e",))
    encoded = dialect.encode(Request(1, "1+1=", None, None, 8, {"temperature": 1.0}), settings)
    assert encoded.path == "/generate" and encoded.body["text"] == "1+1=" and encoded.weight == 1
    reply = (b'{"text": "2", "output_ids": [50], "meta_info": {"finish_reason": {"type": "stop"}, '
             b'"output_token_logprobs": [[-0.5, 50, null]], "weight_version": "3"}}')
    (generation,) = dialect.decode(encoded, reply, settings, "http://e/generate")
    assert list(generation.output_ids) == [50] and generation.weight_version == 3


def test_weight_versions_are_parsed_in_one_place() -> None:
    """``int(...weight_version...)`` parsing outside common/versions.py is a second copy."""
    copies = []
    for folder in ("producer", "integrations", "weight_sync", "consumer", "ops", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if "def parse_version" in text or "def parse_weight_version" in text:
                copies.append(str(path.relative_to(ROOT)))
    assert copies == [], f"parse weight versions with rollstream.common.versions, not in {copies}"
