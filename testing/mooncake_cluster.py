"""A private Mooncake cluster on loopback: a real ``mooncake_master`` (with its HTTP metadata
server) and real store processes (``mooncake_client --global_segment_size``) contributing memory,
for the tests and the benchmarks of the ``mooncake://`` payload store.

The binaries are the ones the ``mooncake`` extra's wheel ships (``mooncake/mooncake_master``,
``mooncake/mooncake_client``). Every process runs under :mod:`rollstream.runtime.parent_death`,
so it dies with the process that started it, and waits are on conditions: the master is ready
when its admin server says ``service_ready``, a store process when the master lists its segment.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from rollstream.common.errors import ExtraNotInstalled
from rollstream.runtime.children import WorkDir, log_tail, spawn, stop_processes, wait_until
from rollstream.runtime.redis_server import free_port

logger = logging.getLogger(__name__)


def mooncake_binary(name: str) -> str:
    """Path of ``name`` (``mooncake_master``, ``mooncake_client``) in the installed ``mooncake``
    package; ``ExtraNotInstalled`` without it."""
    spec = importlib.util.find_spec("mooncake")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / name
        if candidate.is_file():
            return str(candidate)
    raise ExtraNotInstalled("mooncake", "mooncake", f"a Mooncake cluster ({name})")


def mooncake_unavailable() -> str | None:
    """Why Mooncake cannot run here (a reason for a test's skip), None when it can."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"Mooncake's wheels are for Linux x86_64 only (this is {platform.system()} {platform.machine()})"
    try:
        mooncake_binary("mooncake_master")
    except ExtraNotInstalled as exc:
        return str(exc)
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        return f"Mooncake's client does not load ({exc}): apt-get install libibverbs1 libnuma1"
    return None


@dataclass
class StoreProcess:
    """One ``mooncake_client`` contributing ``segment`` of memory."""

    process: subprocess.Popen[bytes]
    log: Path
    segment_name: str = ""
    segments_before: set[str] = field(default_factory=set)


class MooncakeCluster:
    """A master and ``stores`` store processes on free loopback ports; ``url`` is the payload
    store URL that reaches them. ``kill_store`` / ``kill_master`` SIGKILL (faults);
    ``start_master`` / ``start_store`` bring them back."""

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        *,
        stores: int = 1,
        segment: str = "256MB",
        lease_ms: int | None = None,
        client_ttl: int | None = None,
    ) -> None:
        self._workdir = WorkDir(dir, "rollstream-mooncake-")
        self.dir = self._workdir.path
        self.n_stores = stores
        self.segment = segment
        self.lease_ms = lease_ms
        self.client_ttl = client_ttl
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.admin_port = free_port()
        self.master: subprocess.Popen[bytes] | None = None
        self.stores: list[StoreProcess] = []
        self._logs = 0

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata}&admin=127.0.0.1:{self.admin_port}"

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        self._logs += 1
        log = self.dir / f"{name}-{self._logs}.log"
        return spawn([mooncake_binary(name), *args], log, parent_death=True), log

    # -- master --------------------------------------------------------------------------

    def start_master(self, timeout: float = 30.0) -> None:
        args = [
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.admin_port}", "--metrics_host=127.0.0.1",
            "--logtostderr=true",
        ]
        if self.lease_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ms}")
        if self.client_ttl is not None:
            args.append(f"--client_ttl={self.client_ttl}")
        self.master, log = self._spawn("mooncake_master", args)
        wait_until(self._master_ready, what="mooncake_master ready", timeout=timeout, process=self.master, log=log)
        logger.info("mooncake_master pid %d on 127.0.0.1:%d", self.master.pid, self.rpc_port)

    def _master_ready(self) -> bool:
        try:
            health = _http_get(f"{self.admin}/health")
            _http_get(f"{self.metadata}?key=probe", missing_ok=True)  # 404 for an unknown key: it is up
            return bool(json.loads(health).get("service_ready"))
        except (OSError, ValueError):
            return False

    def segments(self) -> set[str]:
        """The segments the master has mounted (one per live store process)."""
        return {line for line in _http_get(f"{self.admin}/get_all_segments").splitlines() if line.strip()}

    def keys(self) -> set[str]:
        """Every key the master holds."""
        return {line for line in _http_get(f"{self.admin}/get_all_keys").splitlines() if line.strip()}

    def kill_master(self) -> None:
        _kill(self.master)

    # -- store processes -----------------------------------------------------------------

    def start_store(self, timeout: float = 30.0) -> StoreProcess:
        before = self.segments()
        process, log = self._spawn("mooncake_client", [
            f"--global_segment_size={self.segment}",
            f"--master_server_address=127.0.0.1:{self.rpc_port}",
            f"--metadata_server={self.metadata}",
            "--host=127.0.0.1", f"--port={free_port()}", "--protocol=tcp",
            "--logtostderr=true",
        ])
        store = StoreProcess(process, log, segments_before=before)
        self.stores.append(store)
        self.wait_store(store, timeout)
        return store

    def wait_store(self, store: StoreProcess, timeout: float = 30.0) -> None:
        """Until the master lists a segment of ``store`` (after a start, or a master restart)."""
        wait_until(
            lambda: self._mounted(store), what="the master mounting the store process's segment", timeout=timeout,
            process=store.process, log=store.log,
        )

    def _mounted(self, store: StoreProcess) -> bool:
        """Whether the master lists ``store``'s segment; names it the first time (the new one)."""
        try:
            mounted = self.segments()
        except OSError:
            return False
        if store.segment_name:
            return store.segment_name in mounted
        others = {s.segment_name for s in self.stores if s is not store}
        new = mounted - store.segments_before - others
        if new:
            store.segment_name = min(new)
            logger.info("mooncake store process pid %d: segment %s", store.process.pid, store.segment_name)
        return bool(new)

    def kill_store(self, index: int = 0) -> None:
        _kill(self.stores[index].process)

    def wait_segment_gone(self, index: int = 0, timeout: float = 60.0) -> None:
        """Until the master unmounts a dead store process's segment (after ``--client_ttl``)."""
        name = self.stores[index].segment_name
        wait_until(lambda: name not in self.segments(), what=f"the master unmounting segment {name}",
                   timeout=timeout, interval=0.1)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> MooncakeCluster:
        self.start_master()
        for _ in range(self.n_stores):
            self.start_store()
        return self

    def stop(self) -> None:
        children = [store.process for store in self.stores]
        if self.master is not None:
            children.append(self.master)
        stop_processes(children, timeout=10.0)

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log_tail(log)}" for log in sorted(self.dir.glob("*.log")))

    def close(self) -> None:
        self.stop()
        self._workdir.cleanup()

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _kill(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait()


def _http_get(url: str, *, missing_ok: bool = False, timeout: float = 2.0) -> str:
    """The body of ``url`` (``OSError`` when it cannot be fetched; a 404 is an answer with ``missing_ok``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return str(answer.read().decode())
    except urllib.error.HTTPError as exc:
        if missing_ok and exc.code == 404:
            return ""
        raise
