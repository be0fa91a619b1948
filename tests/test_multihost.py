"""Many hosts for real: Linux network namespaces joined by a bridge, one namespace per host.

Redis runs in one namespace, two producers in two others (each with its own engine simulator
on its own loopback), the trainer in a fourth; they talk over the bridge's addresses only
(198.18.0.0/24, the range reserved for network tests, existing only inside the namespaces the
test creates). Then one producer's link is cut for longer than the lease: the other producer
reclaims its prompts and the batches stay exact; when the link comes back, the cut-off
producer's late publishes are discarded as duplicates and counted. Nothing is lost or doubled.

Needs root and ``ip`` (iproute2): skipped, with the reason printed, where namespaces are not
allowed. Marked slow (about a minute).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import redis_binary_under_test

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SUBNET = "198.18.0"
HOSTS = {"redis": 1, "p1": 2, "p2": 3, "trainer": 4}
LEASE = 3.0
PROMPTS = 48
BATCH = 4


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def _namespaces_allowed() -> str | None:
    """None when this machine lets us create namespaces, else the reason."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed; .ci/run installs it"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"rsprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


class Hosts:
    """The namespaces, the bridge, and every process started inside them."""

    def __init__(self, tmp: Path) -> None:
        self.tag = f"rs{os.getpid() % 100000}"
        self.tmp = tmp
        self.switch = f"{self.tag}-sw"
        self.children: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def build(self) -> None:
        for name in [self.switch, *(self.ns(h) for h in HOSTS)]:
            _run("ip", "netns", "add", name)
            self.made.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in HOSTS:
            port = self.port(host)
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", self.ns(host))
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", self.ns(host), "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _run("ip", "-n", self.ns(host), "link", "set", "eth0", "up")

    def port(self, host: str) -> str:
        return f"to-{host}"

    def link(self, host: str, up: bool) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.port(host), "up" if up else "down")

    def start(self, host: str, name: str, *cmd: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as handle:
            child = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], stdout=handle,
                                     stderr=subprocess.STDOUT)
        self.children.append((child, log))
        return child

    def cli(self, host: str, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.start(host, name, sys.executable, "-m", "rollstream.cli", *args)

    def run_in(self, host: str, *cmd: str, timeout: float = 60) -> str:
        done = subprocess.run(["ip", "netns", "exec", self.ns(host), *cmd], capture_output=True, text=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} in {host} failed: {done.stdout}{done.stderr}\n{self.logs()}")
        return done.stdout

    def snapshot(self, ns: str) -> dict[str, Any]:
        url = f"redis://{self.addr('redis')}:6379/0"
        out = self.run_in("trainer", sys.executable, str(HERE / "pipeline_probe.py"), "snapshot", url, ns)
        return dict(json.loads(out))

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2500:]}" for _, log in self.children)

    def teardown(self) -> None:
        for child, _ in reversed(self.children):
            if child.poll() is None:
                child.terminate()
        for child, _ in self.children:
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for name in self.made:
            _run("ip", "netns", "del", name, check=False)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    reason = _namespaces_allowed()
    if reason:
        print(f"SKIP multi-host test: {reason}")
        pytest.skip(reason)
    topology = Hosts(tmp_path)
    try:
        topology.build()
        yield topology
    finally:
        topology.teardown()


def _wait(predicate: Any, timeout: float, what: str, hosts: Hosts) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{hosts.logs()}")


def test_partitioned_producer_is_taken_over_and_its_late_publishes_discarded(hosts: Hosts, tmp_path: Path) -> None:
    ns = "multihost"
    url = f"redis://{hosts.addr('redis')}:6379/0"
    hosts.start("redis", "redis", redis_binary_under_test(), "--bind", hosts.addr("redis"), "--port", "6379",
                "--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--protected-mode", "no")
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"Compute {i} + 1.", "label": str(i + 1)}) + "\n"
                               for i in range(PROMPTS)))
    _wait(lambda: _ping(hosts, url), 20, "redis over the bridge", hosts)
    hosts.run_in("trainer", sys.executable, "-m", "rollstream.cli", "init", "--redis", url, "--ns", ns,
                 "--n-samples", "2", "--batch-size", str(BATCH), "--lease", str(LEASE), "--max-backlog", "64",
                 "--heartbeat-timeout", "30")
    hosts.run_in("trainer", sys.executable, "-m", "rollstream.cli", "feed", str(dataset), "--redis", url, "--ns", ns)
    for producer in ("p1", "p2"):
        # Each sample takes 30 tokens x 50 ms = 1.5 s on the producer's own engine.
        hosts.cli(producer, f"sim-{producer}", "sim-engine", "--host", "127.0.0.1", "--port", "30000",
                  "--mean-tokens", "30", "--length-sigma", "0", "--latency-per-token", "0.05", "--accuracy", "0.5")
    for producer in ("p1", "p2"):
        _wait(lambda p=producer: _engine_up(hosts, p), 20, f"the engine of {producer}", hosts)
        hosts.cli(producer, producer, "produce", "--redis", url, "--ns", ns, "--engine", "http://127.0.0.1:30000",
                  "--concurrency", "8", "--reward", "math", "--max-new-tokens", "64", "--name", producer,
                  "--heartbeat-interval", "0.5", "--log-level", "DEBUG")
    out = tmp_path / "trainer.json"
    trainer = hosts.start("trainer", "trainer", sys.executable, str(HERE / "pipeline_probe.py"), "trainer", url, ns,
                          str(PROMPTS), str(BATCH), str(out))

    # Both producers working; cut p1 while it holds prompts.
    _wait(lambda: hosts.snapshot(ns)["pending"].get("producers/p1", 0) >= 2, 30, "p1 holding prompts", hosts)
    held = hosts.snapshot(ns)["pending"]["producers/p1"]
    cut_at = time.monotonic()
    hosts.link("p1", up=False)
    # p2 takes them over once they are idle past the lease; p1 cannot renew across the cut.
    reclaimed = _wait(lambda: int(hosts.snapshot(ns)["state"].get("reclaimed", 0)) or None, 30,
                      "p2 reclaiming p1's prompts", hosts)
    taken_over_after = time.monotonic() - cut_at
    time.sleep(max(0.0, 2 * LEASE - (time.monotonic() - cut_at)))
    partitioned_for = time.monotonic() - cut_at
    hosts.link("p1", up=True)
    healed_at = time.monotonic()

    trainer_code = trainer.wait(180)
    assert trainer_code == 0, hosts.logs()
    result = json.loads(out.read_text())
    indexes = sorted(t["index"] for t in result["taken"])
    assert indexes == list(range(PROMPTS)), "every prompt exactly once"
    # p1's late publishes reach Redis after the heal and are discarded.
    final = _wait(lambda: (s := hosts.snapshot(ns)) and int(s["state"].get("duplicates_discarded", 0)) >= 1 and s,
                  60, "p1's late publishes counted as duplicates", hosts)
    assert final["groups"] == 0 and final["prompts"] == 0 and final["dead"] == 0
    assert int(final["state"]["committed"]) == PROMPTS
    assert not final["pending"], final["pending"]
    by_producer = {p: sum(1 for t in result["taken"] if t["producer"] == p) for p in ("p1", "p2")}
    gaps = [b - a for a, b in zip([result["started"], *result["batches"]], result["batches"], strict=False)]
    figures = {
        "held_by_p1_at_cut": held, "partitioned_s": round(partitioned_for, 1),
        "taken_over_after_s": round(taken_over_after, 1), "reclaimed": int(final["state"]["reclaimed"]),
        "duplicates_discarded": int(final["state"]["duplicates_discarded"]), "groups_lost": 0,
        "longest_gap_between_batches_s": round(max(gaps), 1), "groups_by_producer": by_producer,
        "healed_to_done_s": round(time.monotonic() - healed_at, 1), "reclaimed_when_detected": reclaimed,
    }
    print("MULTIHOST FIGURES", json.dumps(figures))
    for child, _ in hosts.children:
        if child.poll() is not None and child is not trainer:
            raise AssertionError(f"a process died early\n{hosts.logs()}")
    hosts.teardown()
    for name in ("p1", "p2"):
        log = (tmp_path / f"{name}.log").read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
    assert "duplicate" in (tmp_path / "p1.log").read_text(errors="replace").lower()


def _ping(hosts: Hosts, url: str) -> bool:
    try:
        hosts.run_in("trainer", sys.executable, "-c",
                     f"import redis; redis.Redis.from_url({url!r}, socket_timeout=1).ping()", timeout=10)
    except AssertionError:
        return False
    return True


def _engine_up(hosts: Hosts, host: str) -> bool:
    try:
        hosts.run_in(host, sys.executable, "-c",
                     "import httpx; httpx.get('http://127.0.0.1:30000/health', timeout=1).raise_for_status()",
                     timeout=10)
    except AssertionError:
        return False
    return True
