"""The deploy files are valid for the tools that read them, and their rollstream commands parse.

* Kubernetes manifests against the Kubernetes schemas (``kubernetes-validate --strict``);
* compose files against the compose specification (``check-jsonschema``, vendor.compose-spec);
* every ``rollstream`` command line in them parses with the real CLI (``$(VAR)`` expanded);
* producers drain within their grace period; no password on any command line;
* the compose file's Redis command really starts a password-protected Redis with AOF.

The validators are installed by ``.ci/run``; elsewhere those two tests skip with the reason.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
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
            if container.get("image", "").startswith("rollstream") and "command" not in container:
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
            if "build" in service and "entrypoint" not in service:  # the image's rollstream, not Mooncake's binaries
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


def _mooncake_commands(kind: str) -> tuple[list[str], list[str], str]:
    """(mooncake_master args, mooncake_client args, the payload store URL) as a deploy file says."""
    if kind == "compose":
        services = yaml.safe_load((DEPLOY / "docker-compose.mooncake.yml").read_text())["services"]
        assert services["mooncake-master"]["entrypoint"] == ["mooncake_master"]
        master = list(services["mooncake-master"]["command"])
        assert services["mooncake-store"]["entrypoint"] == ["sh", "-c"]
        script = services["mooncake-store"]["command"][0].replace('"$$(hostname -i)"', "127.0.0.1")
        words = shlex.split(script)
        assert words[:2] == ["exec", "mooncake_client"], words
        init = services["init"]["command"]
        return master, words[2:], init[init.index("--payload-store") + 1]
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "mooncake.yaml").read_text()) if d]
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    master = _containers(by_name["Deployment", "rollstream-mooncake-master"])[0]
    store = _containers(by_name["StatefulSet", "rollstream-mooncake-store"])[0]
    assert master["command"] == ["mooncake_master"] and store["command"] == ["mooncake_client"]
    url = by_name["ConfigMap", "rollstream-mooncake"]["data"]["PAYLOAD_STORE"]
    return list(master["args"]), [a.replace("$(POD_IP)", "127.0.0.1") for a in store["args"]], url


@pytest.mark.parametrize("kind", ["compose", "k8s"])
async def test_mooncake_deploy_runs_a_store_the_payload_url_reaches(kind: str, tmp_path: Path) -> None:
    """The deploy file's mooncake_master and mooncake_client commands, run for real on loopback
    (hosts and ports mapped, the segment shrunk), serve the URL its namespace is given: an object
    put through it is read back and deleted."""
    from rollstream.common.payload import open_store
    from rollstream.testing.mooncake_cluster import mooncake_binary, mooncake_unavailable

    reason = mooncake_unavailable()
    if reason is not None:
        pytest.skip(f"Mooncake cannot run here: {reason}")
    master_args, store_args, url = _mooncake_commands(kind)
    ports = {port: str(free_port()) for port in ("50051", "8080", "9003", "50052")}

    def local(text: str) -> str:
        text = re.sub(r"(rollstream-)?mooncake-master", "127.0.0.1", text)
        text = re.sub(r"\b(50051|8080|9003|50052)\b", lambda m: ports[m.group(1)], text)
        return re.sub(r"--global_segment_size=\w+", "--global_segment_size=64MB", text)

    children = []
    try:
        for name, args in (("mooncake_master", master_args), ("mooncake_client", store_args)):
            with (tmp_path / f"{name}.log").open("wb") as log:
                children.append(subprocess.Popen(  # noqa: ASYNC220
                    [sys.executable, "-m", "rollstream.runtime.parent_death", str(os.getpid()), "--",
                     mooncake_binary(name), *map(local, args)], stdout=log, stderr=subprocess.STDOUT))
            if name == "mooncake_master":
                await _until_mounted(f"http://127.0.0.1:{ports['9003']}", None, children, tmp_path)
        await _until_mounted(f"http://127.0.0.1:{ports['9003']}", 1, children, tmp_path)
        store = open_store(local(url))
        await store.put("deploy/obj", [b"routing replay"])
        assert bytes(await store.get("deploy/obj", 14)) == b"routing replay"
        assert [item async for item in store.list("deploy/")] == [("deploy/obj", 14)]
        await store.close()
    finally:
        for child in children:
            child.terminate()
            child.wait(10)


async def _until_mounted(admin: str, segments: int | None, children: list[subprocess.Popen[bytes]],
                         logs: Path) -> None:
    """Until the master answers (``segments`` None) or has mounted that many segments."""
    import httpx

    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if any(child.poll() is not None for child in children):
                raise AssertionError("a Mooncake process of the deploy file exited:\n" + "\n".join(
                    p.read_text(errors="replace")[-2000:] for p in logs.glob("*.log")))  # noqa: ASYNC240
            try:
                if segments is None:
                    if (await http.get(f"{admin}/health")).status_code == 200:
                        return
                elif len((await http.get(f"{admin}/get_all_segments")).text.split()) >= segments:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"the Mooncake processes of the deploy file did not come up within 60 s: {admin}")
