"""The ``fs:///path`` payload store: one file per object under a POSIX directory (local disk,
``/dev/shm``, NFS, Lustre: any directory every producer and trainer mounts at the same path).

A put writes a hidden temporary file beside the object's (``.<name>.<random>.part``) and renames
it over the object's name, so a reader sees the whole object or nothing; a producer killed in the
middle leaves only the temporary file, which the sweep of that object's intent removes. A get maps
the file read-only (``mmap``): numpy views on it share the page cache, no copy. A file unlinked
while mapped stays readable through the mapping (POSIX), so freeing an object never breaks a
batch already holding it. ``?fsync=1`` syncs each object before the rename (off by default: a
process crash keeps what it wrote; only a host crash can lose an unsynced object, and a lost
object is then recycled, never trained short).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import logging
import mmap
import os
import secrets
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from ..errors import ConfigError, PayloadCorrupt, PayloadMissing, PayloadStoreFull, PayloadUnreadable
from .refs import Buffer, check_key
from .store import PayloadStore

logger = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT)
_PART = ".part"


def fs_root(url: str) -> tuple[Path, bool]:
    """The directory of an ``fs:///absolute/dir`` URL and whether it asks for fsync; ``ConfigError``
    for anything else (a host, a relative path, an unknown option)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "fs" or parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ConfigError(f"payload store URL {url!r}: expected fs:///absolute/directory")
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(options) - {"fsync"}
    if unknown or options.get("fsync", "0") not in ("0", "1"):
        raise ConfigError(f"payload store URL {url!r}: the only option is fsync=0|1")
    return Path(parts.path), options.get("fsync") == "1"


class FsStore(PayloadStore):
    """Objects as files under one directory; see the module's docstring."""

    def __init__(self, url: str) -> None:
        self.root, self.fsync = fs_root(url)
        self.url = url

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    # -- put -------------------------------------------------------------------------------

    async def put(self, key: str, parts: Sequence[Buffer]) -> None:
        await asyncio.to_thread(self._put, self.path(key), key, parts)

    def _put(self, final: Path, key: str, parts: Sequence[Buffer]) -> None:
        temporary = final.with_name(f".{final.name}.{secrets.token_hex(6)}{_PART}")
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb", buffering=0) as handle:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        written = handle.write(view)
                        view = view[written or 0 :]
                if self.fsync:
                    os.fsync(handle.fileno())
            os.rename(temporary, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temporary.unlink()
            if exc.errno in _FULL:
                raise PayloadStoreFull(self.url, key, f"no room in {self.root}: {exc.strerror}") from None
            raise PayloadUnreadable(self.url, key, f"cannot write {final}: {exc.strerror or exc}") from None

    # -- get -------------------------------------------------------------------------------

    async def get(self, key: str, size: int) -> memoryview:
        return await asyncio.to_thread(self._get, self.path(key), key, size)

    def _get(self, path: Path, key: str, size: int) -> memoryview:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise PayloadMissing(self.url, key, f"no file {path}") from None
        except OSError as exc:
            raise PayloadUnreadable(self.url, key, f"cannot open {path}: {exc.strerror}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise PayloadCorrupt(self.url, key, f"{path} holds {actual} bytes, its entry says {size}")
            if size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
        except OSError as exc:
            raise PayloadUnreadable(self.url, key, f"cannot map {path}: {exc.strerror}") from None
        finally:
            os.close(fd)

    async def stat(self, key: str) -> int | None:
        return await asyncio.to_thread(self._stat, self.path(key), key)

    def _stat(self, path: Path, key: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise PayloadUnreadable(self.url, key, f"cannot stat {path}: {exc.strerror}") from None

    # -- delete, list ----------------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> list[str]:
        return await asyncio.to_thread(self._delete, list(keys))

    def _delete(self, keys: list[str]) -> list[str]:
        gone = []
        for key in keys:
            path = self.path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("payload store %s: cannot remove %s: %s", self.url, path, exc.strerror)
                continue
            self._remove_partials(path)
            gone.append(key)
        return gone

    def _remove_partials(self, path: Path) -> None:
        """The temporary files of puts of this key that never finished (their writer died)."""
        with contextlib.suppress(OSError):
            for partial in path.parent.glob(f".{path.name}.*{_PART}"):
                with contextlib.suppress(FileNotFoundError):
                    partial.unlink()

    async def list(self, prefix: str) -> AsyncIterator[tuple[str, int]]:
        found = await asyncio.to_thread(self._list, prefix)
        for item in found:
            yield item

    def _list(self, prefix: str) -> builtins.list[tuple[str, int]]:
        found = []
        try:
            for directory, folders, files in os.walk(self.root):
                folders[:] = [f for f in folders if not f.startswith(".")]
                base = Path(directory).relative_to(self.root)
                for name in files:
                    if name.startswith("."):
                        continue
                    key = (base / name).as_posix()
                    if key.startswith(prefix):
                        with contextlib.suppress(FileNotFoundError):
                            found.append((key, (Path(directory) / name).stat().st_size))
        except OSError as exc:
            raise PayloadUnreadable(self.url, prefix, f"cannot list {self.root}: {exc.strerror}") from None
        return sorted(found)

    async def close(self) -> None:
        return None
