"""The payload store's interface: where the per-token arrays that leave a group's stream entry
live (``rollstream init --payload-store URL``), behind one small class per backend.

A backend is a :class:`PayloadStore`: ``put`` (atomic), ``get`` (a buffer, zero-copy where the
backend can), ``delete`` (confirmed, key by key), ``list`` (for the orphan sweep and inspection),
``close``. Every method is a coroutine; a backend runs its blocking calls off the event loop
(``asyncio.to_thread``), so a 50 MB write does not stall a producer's other prompts.
:func:`open_store` picks the backend by the URL's scheme: ``fs:///path`` (:mod:`.fs`) and
``mooncake://HOST:PORT?metadata=URL`` (:mod:`.mooncake`, imported on first use).

The stream entry keeps an :class:`ObjectRef` per object (key, size, CRC-32 of the bytes), so a
reader can tell a missing or damaged object from a good one before anything is trained on it.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

from ..connection import redact_url
from ..errors import ConfigError
from .refs import Buffer, ObjectRef, check_key, checksum  # noqa: F401  # the agreed interface's names (issue 48)


class PayloadStore(abc.ABC):
    """A backend of the payload plane. Keys are :func:`check_key` strings; values are bytes.

    Errors are :class:`~rollstream.common.errors.PayloadError` subclasses naming :attr:`url` and
    the key: ``PayloadMissing`` (not there), ``PayloadUnreadable`` (cannot be reached),
    ``PayloadStoreFull`` (no room for a put)."""

    url: str
    """The store's URL, redacted (for messages and ``inspect``)."""

    @abc.abstractmethod
    async def put(self, key: str, parts: Sequence[Buffer]) -> None:
        """Store ``parts`` back to back under ``key``. Atomic: once it returns the whole object is
        readable; a put that fails or is interrupted leaves nothing readable under ``key``
        (``PayloadStoreFull`` when the store has no room)."""

    @abc.abstractmethod
    async def get(self, key: str, size: int) -> memoryview:
        """The object's bytes, ``size`` of them (zero-copy where the backend can: ``fs`` maps the
        file). ``PayloadMissing`` when it is absent, ``PayloadCorrupt`` when it does not hold
        ``size`` bytes, ``PayloadUnreadable`` when the store cannot be read. The checksum is the
        caller's to verify (:func:`checksum`)."""

    batch_reads = False
    """Whether :meth:`get_many` reads several objects at a cost below that many :meth:`get`
    calls (Mooncake: one batch call into one allocation); the plane then fetches a group's
    objects in batches (:meth:`~.plane.PayloadPlane.fetch`), else object by object."""

    async def get_many(self, items: Sequence[tuple[str, int]]) -> list[memoryview]:
        """``get`` of each ``(key, size)``, in order; the first failing key's error raised. This
        default gets them one by one; a backend with :attr:`batch_reads` overrides it."""
        return [await self.get(key, size) for key, size in items]

    @abc.abstractmethod
    async def delete(self, keys: Sequence[str]) -> list[str]:
        """Remove ``keys``; the keys confirmed gone (an absent key counts as gone). A key the
        backend refuses to remove now (Mooncake under a read lease) is left out, so the caller
        keeps it and tries again later."""

    @abc.abstractmethod
    def list(self, prefix: str) -> AsyncIterator[tuple[str, int]]:
        """``(key, size)`` of every object whose key starts with ``prefix`` (sweeps, inspection)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the backend's resources (buffers already returned by ``get`` stay valid)."""

    async def stat(self, key: str) -> int | None:
        """The object's size, None when it is absent (``PayloadUnreadable`` when the store cannot
        be asked). This default lists by the key as a prefix; a backend overrides it with a cheaper
        call (``fs``: one ``stat``)."""
        async for found, size in self.list(key):
            if found == key:
                return size
        return None


def redact_store_url(url: str) -> str:
    """``url`` without its secrets (as Redis URLs are redacted), for messages."""
    return redact_url(url)


def check_store_url(url: object) -> str:
    """``url`` when its scheme names a backend (``fs:///absolute/dir``, ``mooncake://HOST:PORT``),
    else ``ConfigError``; the backend checks the rest when the store is opened."""
    if not isinstance(url, str) or not url or any(c.isspace() for c in url):
        raise ConfigError(f"payload store URL {url!r}: expected fs:///dir or mooncake://host:port?metadata=URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"payload store URL {redact_store_url(url)}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme == "fs":
        from .fs import fs_root

        fs_root(url)
    elif scheme == "mooncake":
        if not parts.hostname or port is None:
            raise ConfigError(f"payload store URL {redact_store_url(url)}: expected mooncake://HOST:PORT?metadata=URL")
        from .mooncake import parse_url  # its options too (no Mooncake import: that waits for first use)

        parse_url(url)
    else:
        raise ConfigError(
            f"payload store URL {redact_store_url(url)}: scheme {scheme!r} is not one of fs://, mooncake://"
        )
    return url


def open_store(url: str) -> PayloadStore:
    """The backend of ``url``: ``fs:///absolute/dir`` (:class:`~.fs.FsStore`) or
    ``mooncake://HOST:PORT?metadata=URL`` (``MooncakeStore``, which needs its extra); anything
    else is ``ConfigError``. Opening checks the URL; it connects on first use where it can."""
    scheme = urlsplit(check_store_url(url)).scheme.lower()
    if scheme == "fs":
        from .fs import FsStore

        return FsStore(url)
    try:
        module = importlib.import_module(f"{__package__}.mooncake")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.mooncake":
            raise
        raise ConfigError(
            f"payload store URL {redact_store_url(url)}: the mooncake backend is not available in this build"
        ) from None
    store: PayloadStore = module.MooncakeStore(url)
    return store
