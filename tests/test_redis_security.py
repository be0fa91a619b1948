"""TLS, ACL users and secrets, against a Redis 7 started with ``--tls-port`` and the ACL file
``deploy/redis/users.acl.template`` rendered for one namespace (certificates made by the test).

* every role (operator, producer, trainer) runs its part of a real pipeline over TLS with its
  ACL user, the producer presenting a client certificate and reading its password from a file;
* each role is refused outside its rules (other namespaces, other commands, server admin);
* no password appears in logs, ``inspect`` (text and JSON), heartbeats, events, any key of the
  namespace, error messages, or the producer's ``/proc/PID/cmdline``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from conftest import ProcessPool, add_prompts, wait_until
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_nodes import Node, make_certs, redis7_binary
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect, redact_url
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.namespace import init_namespace
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis
from rollstream.testing.sim import SimEngine

NS = f"acl{os.getpid()}"
OTHER = Keys(f"other{os.getpid()}")
PASSWORDS = {"producer": "pr0ducer-S3CRET-pw", "trainer": "tra1ner-S3CRET-pw", "operator": "0perator-S3CRET-pw"}
TEMPLATE = Path(__file__).resolve().parent.parent / "deploy" / "redis" / "users.acl.template"


class TlsRedis:
    def __init__(self, node: Node, certs: dict[str, Path]) -> None:
        self.node = node
        self.certs = certs

    def url(self, user: str, *, password: bool = False, client_cert: bool = True) -> str:
        query = {"ssl_ca_certs": str(self.certs["ca"])}
        if client_cert:
            query |= {"ssl_certfile": str(self.certs["client_cert"]), "ssl_keyfile": str(self.certs["client_key"])}
        auth = f"{user}:{PASSWORDS[user]}" if password else user
        return f"rediss://{auth}@127.0.0.1:{self.node.port}/0?{urlencode(query)}"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    binary = redis7_binary()
    work = tmp_path_factory.mktemp("tls-redis")
    certs = make_certs(work / "certs")
    acl = TEMPLATE.read_text().replace("@NS@", NS)
    for user, secret in PASSWORDS.items():
        acl = acl.replace(f"@{user.upper()}_PASSWORD@", secret)
    aclfile = work / "users.acl"
    aclfile.write_text("\n".join(line for line in acl.splitlines() if line and not line.startswith("#")) + "\n")
    node = Node(binary, work / "node", [])
    node.args = ["--port", "0", "--tls-port", str(node.port), "--tls-cert-file", str(certs["server_cert"]),
                 "--tls-key-file", str(certs["server_key"]), "--tls-ca-cert-file", str(certs["ca"]),
                 "--tls-auth-clients", "yes", "--aclfile", str(aclfile), "--save", "", "--bind", "127.0.0.1"]
    node.start(ready={"ssl": True, "ssl_ca_certs": str(certs["ca"]), "ssl_certfile": str(certs["client_cert"]),
                      "ssl_keyfile": str(certs["client_key"]), "username": "operator",
                      "password": PASSWORDS["operator"]})
    yield TlsRedis(node, certs)
    node.stop()


@pytest.fixture
async def operator(tls_redis: TlsRedis) -> AsyncIterator[Any]:
    client = connect(tls_redis.url("operator", password=True))
    await init_namespace(client, Keys(NS), PipelineConfig(n_samples_per_prompt=2, batch_size=2), force=True)
    await client.delete(*(getattr(Keys(NS), k) for k in ("prompts", "groups", "dead", "events", "producers")))
    await init_namespace(client, Keys(NS), PipelineConfig(n_samples_per_prompt=2, batch_size=2), force=True)
    yield client
    await client.aclose()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollstream.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


async def _dump_namespace(client: Any) -> str:
    """Every key of the namespace, every field, as text."""
    out = []
    async for key in client.scan_iter(match=f"rollstream:{{{NS}}}:*"):
        kind = (await client.type(key)).decode()
        if kind == "stream":
            out.append(repr(await client.xrange(key)))
        elif kind == "hash":
            out.append(repr(await client.hgetall(key)))
    return "\n".join(out)


async def test_roles_run_the_pipeline_over_tls_and_no_secret_shows(
    tls_redis: TlsRedis, operator: Any, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    await add_prompts(operator, NS, 6)
    secret_file = tmp_path / "producer.pw"
    secret_file.write_text(PASSWORDS["producer"] + "\n")
    secret_file.chmod(0o600)
    producer = procs.producer(tls_redis.url("producer"), NS, sim.url,
                              "--redis-password-file", str(secret_file), name="tls-producer")
    async with await GroupConsumer.connect(tls_redis.url("trainer", password=True), NS, "trainer") as consumer:
        async with asyncio.timeout(60):
            for step in range(3):
                batch = await consumer.take(2)
                assert await consumer.commit(batch) == 2
                await consumer.set_weight_version(step + 1)
        await consumer.pause()
        await consumer.resume()
    cmdline = (await asyncio.to_thread(Path(f"/proc/{producer.pid}/cmdline").read_bytes)).decode(errors="replace")
    await wait_until(lambda: operator.hget(Keys(NS).producers, "tls-producer"), message="a heartbeat")
    env = {"ROLLSTREAM_REDIS_PASSWORD": PASSWORDS["operator"]}
    text = _cli("inspect", "--redis", tls_redis.url("operator"), "--ns", NS, env=env)
    as_json = _cli("inspect", "--json", "--redis", tls_redis.url("operator"), "--ns", NS, env=env)
    assert as_json.returncode in (0, 1), as_json.stderr
    snap = json.loads(as_json.stdout)
    assert snap["health"]["ok"], as_json.stdout
    assert "tls-producer" in as_json.stdout and "tls-producer" in text.stdout, text.stdout + text.stderr
    # Refused on purpose: a wrong password in a URL, and a malformed URL; neither message shows it.
    wrong = _cli("inspect", "--redis", tls_redis.url("operator").replace("operator@", "operator:WR0NG-S3CRET@"),
                 "--ns", NS)
    assert wrong.returncode != 0
    with pytest.raises(ConfigError) as bad_url:
        connect("redis+sentinel://u:WR0NG-S3CRET@h1:26379")
    await stop(procs)
    assert f"connecting to rediss://producer@127.0.0.1:{tls_redis.node.port}/0?" in procs.log_of(producer)
    shown = "\n".join([
        procs.logs(), procs.log_of(producer), cmdline, text.stdout, text.stderr, as_json.stdout, as_json.stderr,
        wrong.stdout, wrong.stderr, str(bad_url.value), caplog.text, await _dump_namespace(operator),
    ])
    assert "WR0NG-S3CRET" not in shown
    for secret in PASSWORDS.values():
        assert secret not in shown
    assert "S3CRET" not in shown


async def stop(procs: ProcessPool) -> None:
    await procs.astop_all()
    for child, _ in procs.children:
        assert child.returncode == 0, procs.logs()


def test_redact_url() -> None:
    assert redact_url("redis://u:p4ss@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("rediss://:p4ss@h:1/0?ssl_ca_certs=/ca") == "rediss://:***@h:1/0?ssl_ca_certs=/ca"
    assert redact_url("redis://user@h:1/0") == "redis://user@h:1/0"
    assert redact_url("redis+sentinel://a:p4ss@h1:26379,h2:26379/m/0?sentinel_password=x") == (
        "redis+sentinel://a:***@h1:26379,h2:26379/m/0?sentinel_password=***"
    )
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("https://u:tok@gw:31000/v1?api_key=k&model=m") == "https://u:***@gw:31000/v1?api_key=***&model=m"


def test_password_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    monkeypatch.setenv("ROLLSTREAM_REDIS_PASSWORD_FILE", str(pw))
    assert connect("redis://127.0.0.1:1/0").connection_pool.connection_kwargs["password"] == "from-file"
    monkeypatch.setenv("ROLLSTREAM_REDIS_PASSWORD", "from-env")
    monkeypatch.setenv("ROLLSTREAM_REDIS_USERNAME", "who")
    kwargs = connect("redis://127.0.0.1:1/0").connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"]) == ("who", "from-env")
    kwargs = connect("redis://me:in-url@127.0.0.1:1/0").connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"]) == ("me", "in-url")
    monkeypatch.delenv("ROLLSTREAM_REDIS_PASSWORD")
    monkeypatch.setenv("ROLLSTREAM_REDIS_PASSWORD_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="password file"):
        connect("redis://127.0.0.1:1/0")
    for bad in ("http://h/0", "redis+sentinel://h1:26379", "redis://h:1/0?wait_replicas=x",
                "redis://h:1/0?wait_replicas=1&wait_timeout_ms=0", "redis://h:1/0?wait_replicas=1&wait_timeout_ms=60000",
                "redis+cluster://h:1?wait_replicas=1"):
        with pytest.raises(ConfigError):
            connect(bad)


@pytest.mark.parametrize("role", ["producer", "trainer", "operator"])
async def test_each_role_is_refused_outside_its_acl(tls_redis: TlsRedis, operator: Any, role: str) -> None:
    keys = Keys(NS)
    client = connect(tls_redis.url(role, password=True))
    try:
        assert await client.hgetall(keys.config)  # its own namespace: allowed
        refused: list[Callable[[], Awaitable[Any]]] = [
            lambda: client.set("unrelated-key", "1"),  # outside rollstream's keys
            lambda: client.config_get("maxmemory"),  # server administration
            lambda: client.flushall(),
            lambda: client.keys("*"),
        ]
        if role != "operator":  # the operator's rules cover every namespace
            refused += [
                lambda: client.hgetall(OTHER.config),  # another namespace
                lambda: client.xadd(OTHER.prompts, {"index": "0"}),
                lambda: client.publish(OTHER.control, "pause"),  # another namespace's channel
                lambda: client.xtrim(keys.groups, maxlen=0),  # its own namespace, but not its command
            ]
        if role == "producer":
            refused += [lambda: client.publish(keys.control, "pause")]
        for call in refused:
            with pytest.raises((NoPermissionError, ResponseError)) as exc:
                await call()
            assert "NOPERM" in str(exc.value) or "no permissions" in str(exc.value), exc.value
        # A script run by this user is checked too: PUBLISH's Lua on another namespace's keys.
        if role != "operator":
            with pytest.raises((NoPermissionError, ResponseError)):
                await client.eval("return redis.call('XLEN', KEYS[1])", 1, OTHER.groups)
    finally:
        await client.aclose()
    no_cert = connect(tls_redis.url(role, password=True, client_cert=False))
    with pytest.raises(RedisConnectionError):  # the server requires a client certificate
        try:
            await no_cert.ping()
        finally:
            await no_cert.aclose()
    with pytest.raises(AuthenticationError):
        bad = connect(tls_redis.url(role).replace(f"{role}@", f"{role}:not-the-password@"))
        try:
            await bad.ping()
        finally:
            await bad.aclose()


async def test_a_unix_socket_url_reaches_redis_with_its_password_and_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unix:///path?db=N`` (listed in ``connect``'s URL forms) reaches a password-protected
    redis-server over its socket: the URL used to be rebuilt as ``unix:/path``, which redis-py
    refuses."""
    sock = tmp_path / "redis.sock"
    with EmbeddedRedis(extra_args=["--unixsocket", str(sock)]) as server:
        direct = Redis(host="127.0.0.1", port=server.port)
        await direct.config_set("requirepass", "s3cret")
        await direct.aclose()
        monkeypatch.setenv("ROLLSTREAM_REDIS_PASSWORD", "s3cret")
        url = f"unix://{sock}?db=3"
        assert redact_url(url) == f"unix://{sock}?db=3"
        client = connect(url, name="rollstream-unix-test")
        try:
            await client.set("over-the-socket", b"1")
            assert await client.get("over-the-socket") == b"1"
            assert (await client.client_info())["db"] == 3
        finally:
            await client.aclose()
        direct = Redis(host="127.0.0.1", port=server.port, password="s3cret", db=3)
        try:
            assert await direct.get("over-the-socket") == b"1"
        finally:
            await direct.aclose()
