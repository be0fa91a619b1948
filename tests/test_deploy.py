"""The deploy files are valid for the tools that read them, and their rollstream commands parse.

* Kubernetes manifests against the Kubernetes schemas (``kubernetes-validate --strict``);
* compose files against the compose specification (``check-jsonschema``, vendor.compose-spec);
* every ``rollstream`` command line in them parses with the real CLI (``$(VAR)`` expanded);
* producers drain within their grace period; no password on any command line;
* the compose file's Redis command really starts a password-protected Redis with AOF.

The validators are installed by ``.ci/run``; elsewhere those two tests skip with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
from conftest import redis_binary_under_test
from redis_nodes import free_port
from rollstream.cli.main import build_parser

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (.ci/run installs it with the validators)")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = sorted(DEPLOY.glob("docker-compose*.yml"))


def _tool(name: str) -> str:
    here = Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (`pip install {name}`; .ci/run installs it)")
    return found


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_are_valid(manifest: Path) -> None:
    tool = _tool("kubernetes-validate")
    done = subprocess.run([tool, "--strict", "-k", "1.30.0", str(manifest)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("compose", COMPOSE, ids=lambda p: p.name)
def test_compose_files_are_valid(compose: Path) -> None:
    tool = _tool("check-jsonschema")
    done = subprocess.run([tool, "--builtin-schema", "vendor.compose-spec", str(compose)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template", {})
    return list(template.get("spec", {}).get("containers", []))


def test_kubernetes_commands_parse_and_drain_within_the_grace_period() -> None:
    docs = [d for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d]
    config = {k: str(v) for d in docs if d["kind"] == "ConfigMap" for k, v in d["data"].items()}
    seen = 0
    for doc in docs:
        for container in _containers(doc):
            if container.get("image", "").startswith("rollstream"):
                env = {**config, "POD_NAME": "pod-0"}
                args = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in container["args"]]
                parsed = build_parser().parse_args(args)
                assert not any("PASSWORD" in a.upper() or "@" in a for a in args), args
                names = {e["name"] for e in container.get("env", [])}
                assert "ROLLSTREAM_REDIS_PASSWORD" in names
                if parsed.command == "produce":
                    grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                    assert parsed.drain_timeout + 15 <= grace
                seen += 1
    assert seen >= 2


def test_compose_commands_parse_and_keep_the_password_in_a_file() -> None:
    for compose in COMPOSE:
        services = yaml.safe_load(compose.read_text())["services"]
        for name, service in services.items():
            command = service.get("command")
            if "build" in service:
                parsed = build_parser().parse_args(command)
                assert parsed.command in ("init", "feed", "produce"), name
                assert service["environment"]["ROLLSTREAM_REDIS_PASSWORD_FILE"].startswith("/run/secrets/")
                if parsed.command == "produce":
                    grace = int(service["stop_grace_period"].rstrip("s"))
                    assert parsed.drain_timeout + 10 <= grace
            assert "requirepass " not in " ".join(command or []) or "$$(cat /run/secrets/" in " ".join(command)


def test_compose_redis_command_starts_redis_with_a_password_and_aof(tmp_path: Path) -> None:
    command = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["redis"]["command"][0]
    secret = tmp_path / "redis_password"
    secret.write_text("compose-S3CRET\n")
    port = free_port()
    script = (command.replace("$$", "$").replace("/run/secrets/redis_password", str(secret))
              .replace("/tmp/auth.conf", str(tmp_path / "auth.conf")).replace("/data", str(tmp_path))
              .replace("exec redis-server", f"exec {redis_binary_under_test()}")
              + f" --port {port} --bind 127.0.0.1")
    server = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with sync_redis.Redis(port=port, password="compose-S3CRET", socket_timeout=1) as client:
                    assert client.config_get("appendonly") == {"appendonly": "yes"}
                    break
            except sync_redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with sync_redis.Redis(port=port, socket_timeout=1) as anonymous, pytest.raises((sync_redis.ResponseError, sync_redis.AuthenticationError)):
            anonymous.set("k", "v")  # NOAUTH
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"S3CRET" not in cmdline
    finally:
        server.terminate()
        server.wait(10)
    assert os.path.exists(tmp_path / "appendonlydir") or os.path.exists(tmp_path / "appendonly.aof")
