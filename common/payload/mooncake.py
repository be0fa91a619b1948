"""The ``mooncake://MASTER_HOST:PORT?metadata=URL`` payload store: Mooncake's distributed store
(``pip install 'rollstream[mooncake]'``; it needs ``libibverbs1`` and ``libnuma1`` from apt even
over TCP), the backend miles' ``--object-store-backend mooncake`` uses.

Who holds what. A ``mooncake_master`` keeps the object table (and, with
``--enable_http_metadata_server``, the transfer engines' metadata). The bytes live in the memory
that *store processes* contribute (``mooncake_client --global_segment_size 64GB``). Producers and
trainers join with a segment of 0: they own no bytes, so a producer's death never takes its
objects with it. docs/deploy.md runs both.

Calls. Every call of the Mooncake client blocks, so each runs on this store's own small thread
pool (not the loop's default executor: with the master down a call blocks about 4 s, and that
must not starve the loop's other thread work), under ``timeout`` (``?timeout=S``, 60 s).

* ``put`` hands Mooncake the parts where they lie (``batch_put_from_multi_buffers``: one object
  from several buffers, no concatenation, no copy into Mooncake's local buffer). Mooncake's put
  is PutStart / transfer / PutEnd: an object is readable only once whole, and a put that fails
  is revoked (an abandoned one is discarded by the master after 30 s). Mooncake refuses an empty
  value, so every object is stored with one trailing byte (``R``), which a get also checks: a
  key that holds anything else is corrupt, never handed over.
* ``get`` reads straight into memory it allocates for the object (``get_into`` an anonymous
  mapping, populated up front: the bytes land once, where the caller's numpy views read them).
  The mapping asks for transparent huge pages (``MADV_HUGEPAGE``; the kernel's default mode
  ``madvise`` grants them): populating 48 MB in 4 KiB pages ran at 0.8 GB/s here, as slow as
  the transfer itself, against 3.9 GB/s in huge pages. ``get_many`` reads several objects (a
  group's, :meth:`~.plane.PayloadPlane.fetch`) into one such mapping with one
  ``batch_get_into`` (one master query, one transfer batch), each key's result checked as
  ``get`` checks it. The memory of reads whose views are all gone is reused (``_ReadBuffers``,
  up to 1 GiB a store): a trainer's next batch lands in pages already faulted in. Mooncake's
  ``get_buffer`` would avoid even the allocation, but its buffer lives in the client's fixed
  local buffer: a trainer holding a batch would pin it, and the next get fails. ``get``
  (bytes) returns ``b""`` for a missing key, so it is never used.
* ``delete`` is confirmed key by key: removed or absent (``OBJECT_NOT_FOUND``) is gone. Mooncake
  refuses to remove an object under a read lease (``OBJECT_HAS_LEASE``, -706: a get leases the
  object for the master's ``--default_kv_lease_ttl``, 10 s by default); such a key is not
  returned, and the caller tries again later. ``remove(force=True)`` would skip the lease and
  pull the bytes from under a reader of another rank: never used.
* ``list`` and ``stat`` ask the master's admin server (``/get_all_keys``, ``/batch_query_keys``
  on its ``--metrics_port``; ``?admin=HOST:PORT``, default MASTER_HOST:9003): every size or
  existence query of the client (``get_size``, even ``is_exist``) takes a read lease, and a sweep
  that listed would then find every key refusing removal. A put still in flight is not listed.
* A put of a key that exists succeeds and keeps the stored object (Mooncake's put is
  insert-only); rollstream's keys are unique per object, and a reader would see a wrong size or
  checksum (``PayloadCorrupt``), never other bytes as good ones.
* A put whose transfer fails (``TRANSFER_FAIL``: the master placed it on a store process that
  died and is not yet dropped) is revoked by Mooncake and tried again, 3 times, then reported as
  ``PayloadStoreFull`` (no live room: the producer backs off and retries) rather than as a fatal
  error: a store process's death must not stop the producers. Any other failure of a put (the
  master down: ``RPC_FAIL``) is ``PayloadUnreadable``.
* Objects are hard-pinned (``with_hard_pin``): the master never evicts them to make room; a full
  store refuses the put (``PayloadStoreFull``) instead of losing a published object.

Failures name the store and the key. The store process holding an object killed: reads fail with
``TRANSFER_FAIL`` until the master notices (``--client_ttl``, 10 s), then ``OBJECT_NOT_FOUND``;
both are errors (``PayloadUnreadable``, ``PayloadMissing``), so the group is recycled. The master
killed: every call fails (``RPC_FAIL``) until it is back, empty: its objects are gone, a restarted
master knows none (``PayloadMissing``), and deleting them is confirmed.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import ctypes
import functools
import json
import logging
import mmap
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import aiohttp

from ..errors import ConfigError, PayloadCorrupt, PayloadError, PayloadMissing, PayloadStoreFull, PayloadUnreadable
from ..imports import require_extra
from .refs import Buffer, check_key
from .store import PayloadStore, redact_store_url

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MASTER_PORT = 50051
DEFAULT_ADMIN_PORT = 9003
_QUERY_CHUNK = 64
PUT_TRANSFER_ATTEMPTS = 3
_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23
"""Linux 5.14's ``madvise`` that faults a range in, writable (Python 3.11's mmap has no name for it)."""
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
TRAILER = b"R"
"""The byte stored after every object (Mooncake refuses empty values); checked on every get."""

# Mooncake's error codes (mooncake-store/include/types.h) that this module tells apart.
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
TRANSFER_FAIL = -800
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}


def error_name(code: int) -> str:
    return f"{ERROR_NAMES.get(code, 'error')} ({code})"


_OPTIONS = {"metadata", "admin", "local_hostname", "protocol", "device", "replicas", "timeout", "threads"}


@dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """What a ``mooncake://`` URL says (see :func:`parse_url`)."""

    master: str
    """``host:port`` of ``mooncake_master``'s RPC port."""
    metadata: str
    """The transfer engines' metadata: ``http(s)://host:port/metadata`` or ``P2PHANDSHAKE``; every
    store process, producer and trainer must name the same."""
    admin: str
    """``host:port`` of the master's admin/metrics HTTP server (listing)."""
    local_hostname: str | None
    """The address this process registers with (None: the one that reaches the master)."""
    protocol: str
    device: str
    replicas: int
    timeout: float
    threads: int


def parse_url(url: str) -> MooncakeOptions:
    """The options of ``mooncake://MASTER_HOST[:PORT]?metadata=URL[&admin=HOST:PORT]
    [&local_hostname=H][&protocol=tcp|rdma][&device=NAMES][&replicas=N][&timeout=S][&threads=N]``;
    ``ConfigError`` for anything else."""
    shown = redact_store_url(url)
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ConfigError(f"payload store URL {shown}: {exc}") from None
    if parts.scheme.lower() != "mooncake" or not host:
        raise ConfigError(f"payload store URL {shown}: expected mooncake://MASTER_HOST:PORT?metadata=URL")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"payload store URL {shown}: Mooncake takes no user or password")
    if parts.path not in ("", "/") or parts.fragment:
        raise ConfigError(f"payload store URL {shown}: no path or fragment after the master's host:port")
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)):
        if name not in _OPTIONS:
            known = ", ".join(sorted(_OPTIONS))
            raise ConfigError(f"payload store URL {shown}: unknown option {name!r} (known: {known})")
        if name in options:
            raise ConfigError(f"payload store URL {shown}: option {name!r} given twice")
        options[name] = value
    metadata = options.get("metadata", "")
    http_metadata = metadata.startswith(("http://", "https://")) and bool(urlsplit(metadata).hostname)
    if not (metadata == "P2PHANDSHAKE" or http_metadata):
        # Mooncake reads anything else as etcd endpoints, and then retries for minutes.
        raise ConfigError(
            f"payload store URL {shown}: metadata= must be the master's HTTP metadata server "
            f"(http://HOST:PORT/metadata, mooncake_master --enable_http_metadata_server) or P2PHANDSHAKE, "
            f"and the same for every store process, producer and trainer"
        )
    protocol = options.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise ConfigError(f"payload store URL {shown}: protocol= is tcp or rdma, not {protocol!r}")
    admin = options.get("admin", f"{_bracket(host)}:{DEFAULT_ADMIN_PORT}")
    try:
        admin_parts = urlsplit(f"//{admin}")
        admin_ok = bool(admin_parts.hostname) and admin_parts.port is not None and admin_parts.path == ""
    except ValueError:
        admin_ok = False
    if not admin_ok:
        raise ConfigError(f"payload store URL {shown}: admin= is HOST:PORT (the master's --metrics_port)")
    local_hostname = options.get("local_hostname") or None
    return MooncakeOptions(
        master=f"{_bracket(host)}:{port or DEFAULT_MASTER_PORT}",
        metadata=metadata,
        admin=admin,
        local_hostname=local_hostname,
        protocol=protocol,
        device=options.get("device", ""),
        replicas=_number(options, "replicas", 1, int, shown, minimum=1),
        timeout=_number(options, "timeout", 60.0, float, shown, minimum=0.1),
        threads=_number(options, "threads", 4, int, shown, minimum=1),
    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _number(options: dict[str, str], name: str, default: T, kind: Callable[[str], T], shown: str, *,
            minimum: float) -> T:
    if name not in options:
        return default
    try:
        value = kind(options[name])
    except ValueError:
        raise ConfigError(f"payload store URL {shown}: {name}= must be a number, not {options[name]!r}") from None
    if not value >= minimum:  # type: ignore[operator]
        raise ConfigError(f"payload store URL {shown}: {name}= must be at least {minimum}")
    return value


# -- buffer addresses ----------------------------------------------------------------------


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the stable buffer ABI)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE = 0


def address(view: memoryview) -> int:
    """The address of the first byte of ``view`` (C-contiguous, read-only ones too: a put never
    writes). Valid while ``view`` is alive: ``view`` holds its own export of the memory."""
    info = _PyBuffer()
    if _get_buffer(view, ctypes.byref(info), _PYBUF_SIMPLE) != 0:  # pragma: no cover - raises instead
        raise BufferError("no address for this buffer")
    try:
        return int(info.buf or 0)
    finally:
        _release_buffer(ctypes.byref(info))


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes, which lets go of the GIL during the call (mmap's own
    ``madvise`` holds it: populating 1 GB stalled every other thread 5 s here); None without."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - Linux has it
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_madvise = _libc_madvise()


def _read_buffer(size: int) -> mmap.mmap:
    """Anonymous memory for ``size`` bytes a get writes, faulted in before the read (faulting
    the pages in one by one under the read halved its speed here, and a bytearray is zero-filled
    first), in huge pages where the kernel grants them (``MADV_HUGEPAGE``: 512 times fewer
    faults). Populated by ``MADV_POPULATE_WRITE`` with the GIL let go; where the kernel has no
    such advice (before 5.14), ``MAP_POPULATE`` in 4 KiB pages as before."""
    if size < _HUGE_PAGE or _madvise is None:
        return mmap.mmap(-1, size, flags=_ANONYMOUS | _POPULATE)
    memory = mmap.mmap(-1, size, flags=_ANONYMOUS)
    where = address(memoryview(memory))
    _madvise(where, size, _MADV_HUGEPAGE)  # advice only: 4 KiB pages where refused
    if _madvise(where, size, _MADV_POPULATE_WRITE) != 0:
        memory.close()
        return mmap.mmap(-1, size, flags=_ANONYMOUS | _POPULATE)
    return memory


READ_POOL_BYTES = 1 << 30
"""Read memory one store keeps for reuse (see :class:`_ReadBuffers`)."""


def _exported(memory: mmap.mmap) -> bool:
    """Whether some buffer (a memoryview, a numpy array on one, ...) still refers to ``memory``:
    CPython's mmap refuses to resize while any is alive (a resize to its own size does nothing)."""
    try:
        memory.resize(len(memory))
    except BufferError:
        return True
    return False


class _ReadBuffers:
    """Read memory reused once nothing refers to it any more. Fresh anonymous memory costs the
    kernel a fault and a zeroing of every page (here, a VM, as much as the transfer itself);
    a trainer reads batch after batch of like sizes, and the buffers of the batch it let go are
    free again. A buffer is reused only when no view of it is alive (:func:`_exported`, asked
    under the lock, and the new view made under it); up to :data:`READ_POOL_BYTES` of buffers
    are kept (in use or free), sizes rounded up to 2 MiB; past that, free ones are let go."""

    def __init__(self, keep: int = READ_POOL_BYTES) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._buffers: list[mmap.mmap] = []

    def take(self, size: int) -> memoryview:
        """``size`` bytes of writable memory, nothing else referring to it."""
        if size < _HUGE_PAGE // 2:
            return memoryview(_read_buffer(size))
        capacity = -(-size // _HUGE_PAGE) * _HUGE_PAGE
        with self._lock:
            for memory in self._buffers:
                if len(memory) == capacity and not _exported(memory):
                    return memoryview(memory)[:size]
            held = sum(len(memory) for memory in self._buffers)
            if held + capacity > self.keep:
                free = [memory for memory in self._buffers if not _exported(memory)]
                self._buffers = [memory for memory in self._buffers if all(memory is not f for f in free)]
                for memory in free:
                    memory.close()
                held -= sum(len(memory) for memory in free)
        memory = _read_buffer(capacity)  # outside the lock: populating takes a while
        view = memoryview(memory)[:size]  # exported before any other thread can see it
        if held + capacity <= self.keep:
            with self._lock:
                self._buffers.append(memory)
        return view

    def close(self) -> None:
        """Let go of the buffers (those still in use stay valid until their views go)."""
        with self._lock:
            self._buffers = []


def _bytes_view(part: Buffer) -> memoryview:
    view = memoryview(part)
    if not view.c_contiguous:
        raise ValueError("a payload part must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# -- the store -----------------------------------------------------------------------------


class MooncakeStore(PayloadStore):
    """Objects in a Mooncake distributed store; see the module's docstring. Opening parses the
    URL; the first call joins the cluster (with a segment of 0)."""

    batch_reads = True

    def __init__(self, url: str) -> None:
        self.options = parse_url(url)
        self.url = redact_store_url(url)
        self._module: Any = None
        self._client: Any = None
        self._config: Any = None
        self._joining = asyncio.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._buffers = _ReadBuffers()
        self._closed = False

    def __repr__(self) -> str:
        return f"MooncakeStore({self.url!r})"

    # -- joining -------------------------------------------------------------------------

    async def _call(self, key: str, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the store's threads, under the timeout."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.options.threads, thread_name_prefix="mooncake")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(fn, *args))
        try:
            async with asyncio.timeout(self.options.timeout):
                return await future
        except TimeoutError:
            raise PayloadUnreadable(
                self.url, key, f"{what} did not finish within {self.options.timeout:g} s (?timeout=)"
            ) from None

    async def _joined(self, key: str) -> Any:
        """The Mooncake client, set up on first use."""
        if self._closed:
            raise PayloadUnreadable(self.url, key, "the store was closed")
        if self._client is not None:
            return self._client
        async with self._joining:
            if self._client is None:
                self._client = await self._call(key, "joining the Mooncake cluster", self._join, key)
        return self._client

    def _join(self, key: str) -> Any:
        module = require_extra("mooncake.store", "mooncake", "the mooncake:// payload store")
        options = self.options
        host, _, port = options.master.rpartition(":")
        host = host.strip("[]")
        try:  # Mooncake's setup retries an absent master for about 90 s: fail fast instead
            with socket.create_connection((host, int(port)), timeout=min(5.0, options.timeout)) as probe:
                local = probe.getsockname()[0]
        except OSError as exc:
            raise PayloadUnreadable(
                self.url, key, f"cannot reach mooncake_master at {options.master}: {exc.strerror or exc}"
            ) from None
        client = module.MooncakeDistributedStore()
        code = client.setup(
            options.local_hostname or local,
            options.metadata,
            0,  # global segment: none, this process owns no bytes (the store processes do)
            0,  # local buffer: none needed, puts and gets go from and into our own buffers
            options.protocol,
            options.device,
            options.master,
        )
        if code != 0:
            raise PayloadUnreadable(
                self.url, key, f"cannot join the Mooncake cluster (master {options.master}, metadata "
                f"{options.metadata}): setup returned {code}; see the Mooncake log lines above"
            )
        config = module.ReplicateConfig()
        config.replica_num = options.replicas
        config.with_hard_pin = True
        self._module, self._config = module, config
        logger.info("payload store %s: joined master %s (metadata %s, %s)", self.url, options.master,
                    options.metadata, options.protocol)
        return client

    # -- put -----------------------------------------------------------------------------

    async def put(self, key: str, parts: Sequence[Buffer]) -> None:
        check_key(key)
        views = [view for view in map(_bytes_view, parts) if view.nbytes]
        views.append(memoryview(TRAILER))
        client = await self._joined(key)
        await self._call(key, "the put", self._put, client, key, views)

    def _put(self, client: Any, key: str, views: list[memoryview]) -> None:
        size = sum(view.nbytes for view in views)
        for _attempt in range(PUT_TRANSFER_ATTEMPTS):
            codes = client.batch_put_from_multi_buffers(
                [key], [[address(view) for view in views]], [[view.nbytes for view in views]], self._config
            )
            code = codes[0] if codes else -1
            if code != TRANSFER_FAIL:
                break
            # Revoked by Mooncake, nothing readable: the master placed it on a store process that
            # does not answer (dead, and still mounted until --client_ttl); the next try may land elsewhere.
            logger.warning("payload store %s: the put of %s failed (%s), trying again", self.url, key, error_name(code))
        if code == 0:
            return
        if code in (NO_AVAILABLE_HANDLE, TRANSFER_FAIL):
            why = ("the store processes' segments are full, or none is up (mooncake_client --global_segment_size)"
                   if code == NO_AVAILABLE_HANDLE else
                   f"{PUT_TRANSFER_ATTEMPTS} tries were placed on store processes that do not answer (down, "
                   f"until the master drops them after its --client_ttl)")
            raise PayloadStoreFull(self.url, key, f"no room for {size - 1} bytes: {why}, {error_name(code)}")
        raise PayloadUnreadable(self.url, key, f"the put of {size - 1} bytes failed: {error_name(code)}")

    # -- get -----------------------------------------------------------------------------

    async def get(self, key: str, size: int) -> memoryview:
        check_key(key)
        if size < 0:
            raise PayloadCorrupt(self.url, key, f"a size of {size} bytes")
        client = await self._joined(key)
        return await self._call(key, "the get", self._get, client, key, size)

    def _get(self, client: Any, key: str, size: int) -> memoryview:
        view = self._buffers.take(size + 1)
        return self._checked(client, key, size, client.get_into(key, address(view), size + 1), view)

    async def get_many(self, items: Sequence[tuple[str, int]]) -> list[memoryview]:
        """Several objects read with one ``batch_get_into`` into one mapping; each checked as
        :meth:`get` checks it, the first failing key's error (in order) raised."""
        for key, size in items:
            check_key(key)
            if size < 0:
                raise PayloadCorrupt(self.url, key, f"a size of {size} bytes")
        if not items:
            return []
        first = items[0][0]
        client = await self._joined(first)
        return await self._call(first, "the get", self._get_many, client, list(items))

    def _get_many(self, client: Any, items: list[tuple[str, int]]) -> list[memoryview]:
        whole = self._buffers.take(sum(size + 1 for _, size in items))
        base = address(whole)
        views, offsets, at = [], [], 0
        for _, size in items:
            views.append(whole[at : at + size + 1])
            offsets.append(base + at)
            at += size + 1
        keys = [key for key, _ in items]
        codes = client.batch_get_into(keys, offsets, [size + 1 for _, size in items])
        if len(codes) != len(items):
            raise PayloadUnreadable(self.url, keys[0], f"a batch read of {len(keys)} objects answered {len(codes)}")
        return [self._checked(client, key, size, code, view)
                for (key, size), code, view in zip(items, codes, views, strict=True)]

    def _checked(self, client: Any, key: str, size: int, code: int, view: memoryview) -> memoryview:
        """``view`` (``size`` + the trailer) as a get answered ``code``: the object's bytes, or
        the error that says why not."""
        if code == OBJECT_NOT_FOUND:
            raise PayloadMissing(
                self.url, key, "not in the Mooncake store (removed, or the store process holding it died)"
            )
        if code == INVALID_PARAMS:  # what Mooncake says when the object does not fit the buffer
            held = client.get_size(key)
            if held >= 0 and held != size + 1:
                raise PayloadCorrupt(self.url, key, f"holds {held - 1} bytes, its entry says {size}")
        if code < 0:
            raise PayloadUnreadable(
                self.url, key, f"cannot read it: {error_name(code)}"
                + (" (is the store process holding it down?)" if code == TRANSFER_FAIL else "")
            )
        if code != size + 1:
            raise PayloadCorrupt(self.url, key, f"holds {code - 1} bytes, its entry says {size}")
        if view[size] != TRAILER[0]:
            raise PayloadCorrupt(self.url, key, "not an object rollstream wrote (no trailing byte)")
        return view[:size].toreadonly()

    async def stat(self, key: str) -> int | None:
        return (await self._sizes(key, [check_key(key)])).get(key)

    # -- delete, list --------------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> list[str]:
        keys = [check_key(key) for key in keys]
        if not keys:
            return []
        try:
            client = await self._joined(keys[0])
            codes = await self._call(keys[0], "the removal", client.batch_remove, keys)
        except PayloadError as exc:
            logger.warning("payload store %s: removing %d objects: %s", self.url, len(keys), exc.detail)
            return []
        gone = []
        for key, code in zip(keys, codes, strict=True):
            if code in (0, OBJECT_NOT_FOUND):
                gone.append(key)
            elif code == OBJECT_HAS_LEASE:
                logger.debug("payload store %s: %s is under a read lease; removed later", self.url, key)
            else:
                logger.warning("payload store %s: cannot remove %s: %s", self.url, key, error_name(code))
        return gone

    async def list(self, prefix: str) -> AsyncIterator[tuple[str, int]]:
        for item in await self._list(prefix):
            yield item

    async def _list(self, prefix: str) -> builtins.list[tuple[str, int]]:
        answer = await self._admin(prefix, "/get_all_keys", {})
        keys = sorted(key for key in answer.splitlines() if key.startswith(prefix) and _is_key(key))
        sizes = await self._sizes(prefix, keys)
        # A key removed meanwhile, or still being put, has no size: not listed.
        return [(key, sizes[key]) for key in keys if key in sizes]

    async def _sizes(self, what: str, keys: builtins.list[str]) -> dict[str, int]:
        """The size of each of ``keys`` that is whole in the store. Asked of the master's admin
        server: every size query of the client (``get_size``, even ``is_exist``) takes a read
        lease, which would make the next delete of the key fail for ``--default_kv_lease_ttl``."""
        sizes: dict[str, int] = {}
        for start in range(0, len(keys), _QUERY_CHUNK):
            chunk = keys[start : start + _QUERY_CHUNK]
            answer = await self._admin(what, "/batch_query_keys", {"keys": ",".join(chunk)})
            try:
                found = json.loads(answer)["data"]
                for key in chunk:
                    entry = found.get(key) or {}
                    replicas = entry.get("values") or [] if entry.get("ok") else []
                    if replicas:
                        sizes[key] = int(replicas[0]["size_"]) - len(TRAILER)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise PayloadUnreadable(self.url, what, f"the master's /batch_query_keys answered {answer[:200]!r}: "
                                        f"{type(exc).__name__}: {exc}") from None
        return sizes

    async def _admin(self, what: str, path: str, params: dict[str, str]) -> str:
        where = f"http://{self.options.admin}{path}"
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.options.timeout)) as http,
                http.get(where, params=params) as answer,
            ):
                answer.raise_for_status()
                return await answer.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PayloadUnreadable(
                self.url, what, f"cannot ask the master's admin server ({where}, ?admin=): {type(exc).__name__}: {exc}"
            ) from None

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        pool, self._pool = self._pool, None
        self._buffers.close()
        if pool is None:
            return
        if client is not None:
            await asyncio.get_running_loop().run_in_executor(pool, client.close)
        pool.shutdown(wait=False)


def _is_key(key: str) -> bool:
    try:
        check_key(key)
    except ConfigError:
        return False
    return True
