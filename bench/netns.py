"""Hosts for the scale benchmark: Linux network namespaces on one bridge, one namespace per host.

The same machinery as ``tests/test_multihost.py`` (a bridge namespace, a veth per host), with
every name prefixed ``rsscale`` and its own subnet, 198.18.23.0/24 (inside the benchmark
network range, existing only inside these namespaces). Needs root and ``ip``; ``allowed()``
says why not. Teardown SIGKILLs the processes left in each namespace (by pid: only ours live
there) and deletes the namespaces, also after a crash of a previous run (``sweep``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

PREFIX = "rsscale"
SUBNET = "198.18.23"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def allowed() -> str | None:
    """None when namespaces can be made here, else the reason."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}-probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _ours() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX + "-")]


def _kill_inside(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep() -> None:
    """Remove what a crashed earlier run left behind (only ``rsscale-`` namespaces)."""
    for name in _ours():
        _kill_inside(name)
        _ip("netns", "del", name, check=False)


class Hosts:
    """``redis``, ``trainer`` and ``h0``..``h{n-1}`` on one bridge."""

    def __init__(self, producer_hosts: int) -> None:
        self.names = ["redis", "trainer", *(f"h{i}" for i in range(producer_hosts))]
        self.switch = f"{PREFIX}-sw"
        self.made: list[str] = []

    @property
    def producer_hosts(self) -> list[str]:
        return self.names[2:]

    def ns(self, host: str) -> str:
        return f"{PREFIX}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{self.names.index(host) + 1}"

    def build(self) -> None:
        sweep()
        for name in [self.switch, *(self.ns(h) for h in self.names)]:
            _ip("netns", "add", name)
            self.made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.names:
            port = f"{PREFIX}-{host}"[:15]
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", self.ns(host))
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", self.ns(host), "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", self.ns(host), "link", "set", "eth0", "up")

    def command(self, host: str, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *args]

    def start(self, host: str, args: Sequence[str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """``args`` inside ``host`` (``ip netns exec`` execs it: the pid is the program's own)."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.command(host, args), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                    start_new_session=True)

    def teardown(self) -> None:
        for name in self.made:
            _kill_inside(name)
        for name in self.made:
            _ip("netns", "del", name, check=False)
        self.made.clear()
