"""``rollstream archive``: the archive stream of fates into Parquet files, exactly once.

The archiver reads records after its cursor, writes each contiguous run of one partition as one
file (:func:`rollstream.common.archive_schema.write_part`: temporary name, fsync, rename), and only then
deletes the records from Redis (Lua ARCHIVED). Its cursor is the highest last id in the files, so
a killed archiver resumes after what it wrote and deletes, on start, the records it wrote but had
not confirmed: nothing is written twice and nothing written is lost. It never slows training: the
scripts that decide a fate drop the oldest records past the namespace's ``archive_bytes`` budget
(``archive_dropped``), and this process warns when that count grows.

One archiver per namespace: it holds a leased name in Redis (``Keys.archiver_lease``, renewed
while it runs, deleted when it stops); a second one is refused, or waits with ``wait_seconds``
for a killed holder's lease to lapse. One that stalled past its lease writes nothing twice: each
file is renamed only right after a renewal of the lease succeeded (its temporary file is removed
otherwise), and ARCHIVED confirms nothing for an archiver that no longer holds it.

One namespace per folder: the folder's ``OWNER_FILE`` names it (:func:`claim_folder`), and
another namespace's archiver is refused there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis
from rollstream.common.archive_schema import (
    ArchiveRecord,
    claim_folder,
    part_metadata,
    partition_of,
    publish_part,
    pyarrow,
    record_row,
    remove_partial,
    write_tmp,
    written_cursor,
)
from rollstream.common.checked import is_int
from rollstream.common.codec import decode_group, encode_group
from rollstream.common.connection import TRANSIENT_ERRORS, Outage
from rollstream.common.errors import ArchiveUnusable, ConfigError, DecodeError, PayloadError
from rollstream.common.events import now_ms
from rollstream.common.keys import Keys
from rollstream.common.namespace import load_config
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.protocol import ArchiveStream, NameLease

logger = logging.getLogger(__name__)

PARTITIONS = ("version", "hour")
_BLOCK_MS = 1000
_DROP_CHECK_S = 5.0
_RELEASE_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *TRANSIENT_ERRORS)


@dataclass(frozen=True, slots=True)
class ArchiveSettings:
    """What one archiver does; checked on construction (``ConfigError``)."""

    namespace: str
    out: Path
    partition: str = "version"
    """Folder per trainer version (``version=N``) or per UTC hour (``hour=YYYYMMDDHH``)."""
    keep_arrays: bool = False
    """Keep the big per-token arrays (routing replay, teacher log-probs) in ``data``."""
    batch: int = 512
    """Records read per call, and the most written per file."""
    flush_seconds: float = 5.0
    """Records read are written within this long, however few."""
    lease_seconds: float = 15.0
    """The archiver's name lease: a killed archiver's lapses after this long."""
    wait_seconds: float = 0.0
    """How long to wait for another archiver's lease to go before refusing to start."""

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if not is_int(self.batch) or self.batch < 1:
            raise ConfigError(f"batch must be a positive integer, got {self.batch!r}")
        if not self.flush_seconds > 0:
            raise ConfigError(f"flush_seconds must be positive, got {self.flush_seconds!r}")
        if not self.lease_seconds >= 1:
            raise ConfigError(f"lease_seconds must be at least 1, got {self.lease_seconds!r}")
        if not self.wait_seconds >= 0:
            raise ConfigError(f"wait_seconds must be >= 0, got {self.wait_seconds!r}")


class Archiver:
    """One namespace's archive stream into ``settings.out``; ``await run()`` until :meth:`stop`."""

    def __init__(self, redis: Redis, blocking: Redis, settings: ArchiveSettings) -> None:
        self.redis = redis
        self.blocking = blocking
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.stream = ArchiveStream(redis, self.keys)
        self.written = 0
        self.files = 0
        self._outage = Outage(logger, f"archiver (ns {settings.namespace})")
        self._stop = asyncio.Event()
        self._dropped: int | None = None
        self._dropped_checked = 0.0
        self._tag = secrets.token_hex(4)
        """In this archiver's temporary file names: a successor's clean-up is told apart from a stall."""
        token = f"{socket.gethostname()} pid {os.getpid()} {self._tag}"
        self.lease = NameLease(redis, self.keys, "archiver", token, key=self.keys.archiver_lease)
        self._renewed = 0.0
        self.plane: PayloadPlane | None = None
        """The namespace's payload store, if any: the offloaded arrays are read from it into each
        record before the record is confirmed, which releases them (the rows keep tokens, masks and
        log-probs; the bulk arrays only with ``keep_arrays``); the archiver then deletes what was released."""

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        """Archive until stopped; the records written by this call. ``ConfigError`` when another
        archiver holds the namespace (after ``wait_seconds``)."""
        pyarrow()  # the extra's absence is a ConfigError now, not after the first read
        await self._take_lease()
        try:
            return await self._run()
        finally:
            if self.plane is not None:
                await self.plane.close()
            try:
                await asyncio.wait_for(self.lease.release(), 5)
            except _RELEASE_ERRORS:  # the lease lapses by itself: say so and go
                logger.warning("archiver (ns %s): could not release its lease; it lapses in %.0f s",
                               self.keys.namespace, self.settings.lease_seconds, exc_info=True)

    async def _take_lease(self) -> None:
        deadline = time.monotonic() + self.settings.wait_seconds
        while not await self._outage.run(functools.partial(self.lease.hold, self._ttl_ms)):
            if time.monotonic() >= deadline:
                holder = await self._outage.run(self.lease.holder)
                raise ConfigError(
                    f"another archiver holds namespace {self.keys.namespace!r} ({holder}): one archiver per "
                    f"namespace (a killed one's lease lapses within {self.settings.lease_seconds:g} s; --wait)"
                )
            await asyncio.sleep(min(0.5, self.settings.lease_seconds / 4))
        self._renewed = time.monotonic()

    @property
    def _ttl_ms(self) -> int:
        return int(self.settings.lease_seconds * 1000)

    def _lease_lost(self, what: str) -> ConfigError:
        return ConfigError(
            f"archiver (ns {self.keys.namespace}): its lease lapsed and another archiver took the namespace "
            f"(this one stalled past --lease-seconds: a pause, a swap storm, a stalled disk); {what}; stopping"
        )

    async def _renew(self) -> None:
        if time.monotonic() - self._renewed < self.settings.lease_seconds / 3:
            return
        await self._hold_fresh("nothing was written after it")

    async def _hold_fresh(self, what: str) -> None:
        """Renew the lease and know it is ours for at least half its length from now: a reply that
        took longer than that (a stall after Redis renewed it) is checked again."""
        while True:
            asked = time.monotonic()
            if not await self._outage.run(functools.partial(self.lease.hold, self._ttl_ms)):
                raise self._lease_lost(what)
            if time.monotonic() - asked < self.settings.lease_seconds / 2:
                self._renewed = asked
                return

    async def _run(self) -> int:
        config = await self._outage.run(lambda: load_config(self.redis, self.keys))
        if config.archive_bytes <= 0:
            raise ConfigError(
                f"namespace {self.keys.namespace!r} keeps no archive (archive_bytes 0): "
                "re-run `rollstream init ... --archive-bytes SIZE --force`"
            )
        if config.payload_store and self.plane is None:
            self.plane = PayloadPlane.open(config.payload_store, self.redis, self.keys, config.lease_seconds)
        out = self.settings.out
        self._prepare(out)
        if partial := remove_partial(out):
            logger.info("archiver (ns %s): removed %d unfinished file(s) of a killed run", self.keys.namespace, partial)
        cursor = written_cursor(out)
        await self._confirm_written(cursor)
        await self._confirm([], "")  # seen: inspect shows it running
        logger.info("archiver (ns %s): writing to %s after record %s", self.keys.namespace, out, cursor)
        buffer: list[ArchiveRecord] = []
        oldest = 0.0
        while not self._stop.is_set():
            read_from = buffer[-1].archive_id if buffer else cursor
            want = self.settings.batch - len(buffer)
            entries = await self._outage.run(
                functools.partial(self.stream.after, read_from, want, self.blocking, _BLOCK_MS)
            )
            if entries and not buffer:
                oldest = time.monotonic()
            buffer.extend(ArchiveRecord.parse(eid, fields) for eid, fields in entries)
            if entries:
                logger.debug("archiver (ns %s): read %d records, %d buffered", self.keys.namespace, len(entries),
                             len(buffer))
            full = len(buffer) >= self.settings.batch
            if buffer and (full or time.monotonic() - oldest >= self.settings.flush_seconds):
                cursor = await self._flush(buffer, cursor)
                buffer = []
            elif not buffer:
                await self._confirm([], "")
            await self._check_drops()
            await self._renew()
        if buffer:
            await self._flush(buffer, cursor)
        return self.written

    def _prepare(self, out: Path) -> None:
        """The ``--out`` folder made if missing and claimed for this namespace (``claim_folder``);
        a file there, a read-only or unwritable folder is ``ArchiveUnusable`` naming the fix."""
        try:
            out.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), out)
            raise ArchiveUnusable(
                f"--out {out}: {file} is a file, not a folder: give --out a folder (made if missing)"
            ) from exc
        except OSError as exc:
            raise ArchiveUnusable(f"--out {out}: the folder cannot be made ({exc.strerror or exc}): "
                                  f"{_fix(exc, out)}") from exc
        try:
            claim_folder(out, self.keys.namespace)
        except OSError as exc:
            raise ArchiveUnusable(f"--out {out}: cannot write there ({exc.strerror or exc}): {_fix(exc, out)}") from exc

    async def _confirm_written(self, cursor: str) -> None:
        """Records at or below ``cursor`` are in the files: delete those still in Redis."""
        if cursor == "0-0":
            return
        while rows := await self._outage.run(lambda: self.stream.up_to(cursor, 1000)):
            await self._confirm([(eid, ArchiveRecord.parse(eid, fields).record_bytes) for eid, fields in rows], cursor)

    async def _confirm(self, pairs: list[tuple[bytes, int]], cursor: str) -> None:
        """Delete confirmed records, in a script that first checks this archiver still holds the lease."""
        token = self.lease.token
        if not await self._outage.run(lambda: self.stream.confirm(pairs, cursor, now_ms(), token)):
            raise self._lease_lost("its files stay (the archiver now holding the namespace counts them)")
        if pairs and self.plane is not None:  # the confirmed records' objects were released: delete them
            try:
                await self.plane.free(rounds=4)
            except Exception as exc:  # the trainer's next commit or a reclaim turn frees them
                logger.warning("archiver (ns %s): freeing payload objects failed: %s", self.keys.namespace, exc)

    async def _inline(self, record: ArchiveRecord) -> ArchiveRecord:
        """With a payload store: the record with its group's offloaded arrays read back into its
        ``data`` (checksums verified), before its confirmation frees them, with or without
        ``--keep-arrays``: the row's tokens, loss masks and log-probs may be in the objects too
        (without the flag :func:`record_row` then drops the bulk arrays). An object that cannot be
        read is logged, the row then keeps the entry as it came and says so (``decode_error``)."""
        plane = self.plane
        if plane is None or b"refs" not in record.fields:
            return record
        try:
            group = decode_group(record.fields.get(b"data", b""))
            if group.payload is None:
                return record
            group.payload.attach(group, await plane.fetch(group.payload), plane.url)
        except (DecodeError, PayloadError) as exc:
            logger.warning("archiver (ns %s): record %s keeps no offloaded arrays: %s", self.keys.namespace,
                           record.archive_id, exc)
            return record
        group.payload = None
        return dataclasses.replace(record, fields={**record.fields, b"data": encode_group(group)})

    async def _flush(self, records: list[ArchiveRecord], after: str) -> str:
        """Write the records (one file per run of one partition, in id order) under temporary
        names, then for each file check the lease and rename it, then confirm them."""
        records = [await self._inline(r) for r in records]
        try:
            written = await asyncio.to_thread(self._write, records, after)
        except ArchiveUnusable:  # a lapsed lease (a successor removed our files) says more
            await self._hold_fresh("its unfinished files were removed")
            raise
        try:
            while written:
                tmp, final, count = written[0]
                await self._hold_fresh("its unfinished files were removed, nothing renamed")
                try:
                    publish_part(tmp, final)  # no await since the check: the lease is ours for L/2 more
                except FileNotFoundError as exc:  # a successor's start removed our temporary file
                    await self._hold_fresh("its unfinished files were removed by its successor")
                    raise ArchiveUnusable(f"{tmp}: the temporary file vanished before its rename ({exc})") from exc
                except OSError as exc:
                    raise ArchiveUnusable(f"{final}: cannot rename it ({exc.strerror or exc}): "
                                          f"{_fix(exc, self.settings.out)}") from exc
                written.pop(0)
                self.written += count
                self.files += 1
                logger.debug("archiver (ns %s): %d records to %s", self.keys.namespace, count, final)
        finally:
            for tmp, _, _ in written:
                tmp.unlink(missing_ok=True)
        cursor = records[-1].archive_id
        await self._confirm([(r.archive_id.encode(), r.record_bytes) for r in records], cursor)
        return cursor

    def _write(self, records: list[ArchiveRecord], after: str) -> list[tuple[Path, Path, int]]:
        """Each run of one partition as a temporary file: (temporary, final, records)."""
        by = self.settings.partition
        runs: list[list[ArchiveRecord]] = []
        for record in records:
            if runs and partition_of(record, by) == partition_of(runs[-1][0], by):
                runs[-1].append(record)
            else:
                runs.append([record])
        written: list[tuple[Path, Path, int]] = []
        try:
            for run in runs:
                rows = [record_row(r, keep_arrays=self.settings.keep_arrays) for r in run]
                metadata = part_metadata(self.keys.namespace, after)
                folder = self.settings.out / partition_of(run[0], by)
                try:
                    tmp, final = write_tmp(self.settings.out, partition_of(run[0], by), rows, metadata, self._tag)
                except OSError as exc:
                    raise ArchiveUnusable(
                        f"{folder}: cannot write the archive's next file ({exc.strerror or exc}): "
                        f"{_fix(exc, self.settings.out)}"
                    ) from exc
                written.append((tmp, final, len(rows)))
                after = run[-1].archive_id
        except BaseException:
            for tmp, _, _ in written:
                tmp.unlink(missing_ok=True)
            raise
        return written

    async def _check_drops(self) -> None:
        now = time.monotonic()
        if now - self._dropped_checked < _DROP_CHECK_S:
            return
        self._dropped_checked = now
        dropped = await self._outage.run(self.stream.dropped)
        if self._dropped is not None and dropped > self._dropped:
            logger.warning(
                "archiver (ns %s): %d fate records were dropped unarchived since the last check (%d in all): "
                "the archive stream reached its archive_bytes budget; this archiver is behind (see `rollstream "
                "inspect`; raise the budget with `rollstream init --archive-bytes`)",
                self.keys.namespace, dropped - self._dropped, dropped,
            )
        elif self._dropped is None and dropped:
            logger.warning(
                "archiver (ns %s): %d fate records were dropped unarchived before this archiver started "
                "(archive_bytes budget reached while no archiver ran)", self.keys.namespace, dropped,
            )
        self._dropped = dropped


def _fix(exc: OSError, out: Path) -> str:
    """What to do about an archive folder the system refused."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk of {out} is full: free space there (or move --out), then restart; the records wait in "
                "Redis meanwhile (past --archive-bytes the oldest are dropped and counted in archive_dropped)")
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{out} is read-only or not writable by this user: give --out a writable folder"
    return f"check {out} (its disk, mount and permissions) and restart"
