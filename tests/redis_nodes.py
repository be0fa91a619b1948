"""Helpers for the production-Redis tests: a Redis 7 binary, throw-away certificates, and
redis-server / sentinel / cluster-node processes with arbitrary arguments on loopback."""

from __future__ import annotations

import random
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


def cluster_free_port() -> int:
    """A free port P below 55535 with P + 10000 (the cluster bus) free too."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


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
        fast_sync = ["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"]
        self.primary = Node(binary, directory / "primary", list(fast_sync))
        self.replica = Node(binary, directory / "replica", list(fast_sync))
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

    def master_ports(self) -> set[int]:
        """The primary's port as each sentinel sees it (they agree once a failover has spread)."""
        ports = set()
        for sentinel in self.sentinels:
            with sentinel.client() as c:
                ports.add(int(c.sentinel_get_master_addr_by_name(self.service)[1]))
        return ports

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.primary]:
            node.stop()


class Cluster:
    """Three primaries and three replicas (Redis 7) on loopback, made with ``redis-cli --cluster``."""

    def __init__(self, binary: str, directory: Path, *, node_timeout_ms: int = 2000) -> None:
        self.cli = shutil.which("redis-cli") or str(Path(binary).with_name("redis-cli"))
        if not Path(self.cli).exists():
            pytest.skip("redis-cli (redis-tools) is not installed; .ci/run installs redis-server, which brings it")
        self.nodes = [
            Node(binary, directory / f"node{i}", ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                                  "--cluster-node-timeout", str(node_timeout_ms), "--save", "",
                                                  "--cluster-require-full-coverage", "no",
                                                  "--repl-diskless-sync-delay", "0",
                                                  "--appendonly", "no", "--bind", "127.0.0.1"],
                 port=cluster_free_port())
            for i in range(6)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self) -> Cluster:
        for node in self.nodes:
            node.start()
        subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                if node.process is None or node.process.poll() is not None:
                    continue
                with node.client() as c:
                    states.append(c.execute_command("CLUSTER", "INFO").decode().split("\r\n")[0])
            if states and all(s == "cluster_state:ok" for s in states) and self._replicas_synced():
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok: {states}")

    def _replicas_synced(self) -> bool:
        """Every replica finished its first sync: one that has not cannot be failed over to."""
        replicas = 0
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            with node.client() as c:
                info = c.info("replication")
            if info.get("role") == "slave":
                replicas += 1
                if info.get("master_link_status") != "up":
                    return False
        return replicas >= 3

    def owner_of(self, key: str) -> Node:
        """The node serving ``key``'s slot now."""
        live = [n for n in self.nodes if n.process is not None and n.process.poll() is None]
        with live[0].client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
        for node in self.nodes:
            if node.process is None or node.process.poll() is not None:
                continue
            with node.client() as c:
                for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = int(primary[1])
                        return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
