"""Helpers for the production-Redis tests: a Redis 7 binary, throw-away certificates, and
redis-server / sentinel / cluster-node processes with arbitrary arguments on loopback."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis7_binary() -> str:
    """Debian's redis-server (>= 7, built with TLS), or skip the test with the reason."""
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server (Redis 7) is not installed: `apt-get install redis-server` (.ci/run does)")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"v=(\d+)\.", out)
    if not match or int(match.group(1)) < 7:
        pytest.skip(f"{path} is not Redis >= 7 ({out.strip()})")
    return path


def make_certs(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (.ci/run installs it)")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / "ca.key", directory / "ca.crt"

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=rollstream-test-ca",
        "-keyout", str(ca_key), "-out", str(ca))
    out: dict[str, Path] = {"ca": ca}
    for role, san in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", None)):
        key, csr, crt = directory / f"{role}.key", directory / f"{role}.csr", directory / f"{role}.crt"
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=rollstream-{role}", "-keyout", str(key),
            "-out", str(csr))
        ext = directory / f"{role}.ext"
        ext.write_text((san + "\n") if san else "basicConstraints=CA:FALSE\n")
        run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-days", "2", "-out", str(crt), "-extfile", str(ext))
        out[f"{role}_cert"], out[f"{role}_key"] = crt, key
    return out


class Node:
    """One redis-server process (plain, sentinel or cluster node) with its own dir and log."""

    def __init__(self, binary: str, directory: Path, args: Sequence[str], *, port: int | None = None,
                 sentinel: bool = False, conf: str = "") -> None:
        self.binary = binary
        self.port = port or free_port()
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.sentinel = sentinel
        self.conf_text = conf
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, ready: dict[str, Any] | None = None, timeout: float = 15.0) -> Node:
        conf = self.dir / ("sentinel.conf" if self.sentinel else "redis.conf")
        if not conf.exists() or not self.sentinel:  # a sentinel rewrites its own config: keep it
            conf.write_text(self.conf_text)
        cmd = [self.binary, str(conf), *(["--sentinel"] if self.sentinel else []),
               "--port", str(self.port), "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "notice",
               *self.args]
        with open(self.dir / "server.log", "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready(ready or {}, timeout)
        return self

    def client(self, **kwargs: Any) -> sync_redis.Redis:
        options = {"host": "127.0.0.1", "port": self.port, "socket_timeout": 5, **kwargs}
        return sync_redis.Redis(**options)

    def wait_ready(self, kwargs: dict[str, Any], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited {self.process.returncode}: {self.log()[-2000:]}")
            try:
                with self.client(socket_timeout=1, **kwargs) as c:
                    c.ping()
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.05)
        raise RuntimeError(f"redis on port {self.port} not ready in {timeout} s: {last}; {self.log()[-2000:]}")

    def log(self) -> str:
        path = self.dir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class SentinelSet:
    """A primary, one replica and three sentinels on loopback (Redis 7), service ``mymaster``."""

    service = "mymaster"

    def __init__(self, binary: str, directory: Path, *, down_after_ms: int = 1000) -> None:
        self.primary = Node(binary, directory / "primary", ["--save", "", "--appendonly", "no"])
        self.replica = Node(binary, directory / "replica", ["--save", "", "--appendonly", "no"])
        self.replica.args += ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.sentinels = []
        for i in range(3):
            conf = (f"sentinel monitor mymaster 127.0.0.1 {self.primary.port} 2\n"
                    f"sentinel down-after-milliseconds mymaster {down_after_ms}\n"
                    "sentinel failover-timeout mymaster 10000\n"
                    "sentinel parallel-syncs mymaster 1\n")
            self.sentinels.append(Node(binary, directory / f"sentinel{i}", [], sentinel=True, conf=conf))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self) -> SentinelSet:
        self.primary.start()
        self.replica.start()
        deadline = time.monotonic() + 20
        with self.replica.client() as c:
            while c.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError("replica did not sync: " + self.replica.log()[-2000:])
                time.sleep(0.05)
        for sentinel in self.sentinels:
            sentinel.start()
        deadline = time.monotonic() + 20
        for sentinel in self.sentinels:  # every sentinel knows the replica and its peers
            with sentinel.client() as c:
                while True:
                    info = c.sentinel_master(self.service)
                    if int(info.get("num-slaves", 0)) >= 1 and int(info.get("num-other-sentinels", 0)) >= 2:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"sentinel not ready: {info}")
                    time.sleep(0.1)
        return self

    def master_port(self) -> int:
        with self.sentinels[0].client() as c:
            return int(c.sentinel_get_master_addr_by_name(self.service)[1])

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.primary]:
            node.stop()
