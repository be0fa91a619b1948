"""One process's payload plane: a store (:mod:`.store`) and the namespace's ledgers in Redis
(:class:`~..protocol.objects.PayloadLedger`), and the steps the producer and the trainer take
with both, in the order that keeps exactly once:

* **put** (producer, before PUBLISH): the objects' intents first (with a deadline), then the
  puts; a put that fails frees what it wrote. PUBLISH turns the intents into claims; a producer
  killed in between leaves intents that the reclaim turn's **sweep** frees after their deadline.
* **fetch** (trainer): each object read as a buffer (``fs``: a map of the file) and its CRC-32
  checked; any failure is a :class:`~..errors.PayloadError` naming the store and the key.
* **free** (trainer after a commit, producers' reclaim turn): the objects the fate scripts
  released are deleted from the store, key by key, and a group's set leaves the to-free set only
  once the store confirmed every key of it gone (Mooncake refuses under a read lease: the set is
  tried again next time; a key already gone counts as gone).

The ledgers hold one member per group (its object set, :func:`~.refs.group_member`), so a
group's intent, claim, release and free cost one Redis command each whatever its sample count.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import zlib
from collections.abc import Sequence
from typing import TypeVar

from redis.asyncio import Redis

from ..codec import StoreObject
from ..errors import PayloadCorrupt, PayloadError
from ..events import now_ms
from ..keys import Keys
from ..protocol.objects import PayloadLedger
from .refs import GroupPayload, ObjectRef, group_member, member_keys
from .store import PayloadStore, open_store

logger = logging.getLogger(__name__)
T = TypeVar("T")

FREE_BATCH = 100
"""Object sets (groups) one free step deletes (the rest wait for the next step)."""
FETCH_CONCURRENCY = 8
"""Objects one fetch reads and checks at once (a store without batch reads)."""
FETCH_BATCH_BYTES = 16 << 20
"""Bytes of objects one batch read asks for (a store with batch reads: Mooncake): a group's
objects in batches of about this size, each batch's checksums computed while the next is read."""
RECONCILE_INTERVAL_S = 600.0
"""How often a producer's reclaim turn lists the store for objects no ledger knows."""
INTENT_LEASES = 2
"""An intent's deadline is this many prompt leases after it is written (before the puts, and
again once they are done): a live producer publishes well within it, a dead one's objects are
swept after it."""


def _result(value: T | BaseException) -> T:
    """A result of ``gather(..., return_exceptions=True)``, its exception raised."""
    if isinstance(value, BaseException):
        raise value
    return value


STEP_REF = b"\xc1"
"""The first byte of a journal step kept in the store: ``0xc1``, which msgpack never uses."""


def step_ref(value: bytes) -> ObjectRef | None:
    """The object a journal step refers to, None for a step kept inline."""
    if not value.startswith(STEP_REF) or len(value) > 256:
        return None
    try:
        key, size, crc = value[1:].decode("ascii").split(" ")
        return ObjectRef.from_wire([key, int(size), int(crc)])
    except ValueError:
        return None


def _key_part(text: str) -> str:
    part = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".-_") or "x"
    return part[:64]


class PayloadPlane:
    """The store and the ledgers of one namespace, for one process."""

    def __init__(self, store: PayloadStore, redis: Redis, keys: Keys, lease_seconds: float = 120.0) -> None:
        self.store = store
        self.keys = keys
        self.ledger = PayloadLedger(redis, keys)
        self.intent_ms = int(INTENT_LEASES * lease_seconds * 1000)
        self._prefix = f"{_key_part(keys.namespace)}/"

    @classmethod
    def open(cls, url: str, redis: Redis, keys: Keys, lease_seconds: float = 120.0) -> PayloadPlane:
        return cls(open_store(url), redis, keys, lease_seconds)

    @property
    def url(self) -> str:
        return self.store.url

    def new_key(self) -> str:
        """A fresh base key, under the namespace's prefix (the sweep's listing): a group's
        objects are named from it (:func:`~.refs.object_keys`)."""
        return self._prefix + secrets.token_hex(16)

    async def put(self, objects: Sequence[StoreObject]) -> None:
        """Intents first, then every object (concurrently); on any failure the objects are
        abandoned (queued to free) and the error raised."""
        if not objects:
            return
        members = [group_member([o.ref.key for o in objects])]
        await self.ledger.intend(members, now_ms() + self.intent_ms)
        try:
            done = await asyncio.gather(*(self.store.put(o.ref.key, o.parts) for o in objects), return_exceptions=True)
            for value in done:
                _result(value)
            await self.ledger.intend(members, now_ms() + self.intent_ms)  # a slow put keeps its full deadline
        except BaseException:
            try:
                await self.ledger.abandon(members, now_ms())
                await self.free()
            except Exception as cleanup:  # the sweep frees them after the deadline
                logger.warning("payload store %s: could not free abandoned objects now: %s", self.url, cleanup)
            raise

    async def fetch(self, payload: GroupPayload) -> dict[str, memoryview]:
        """Every object of ``payload`` read and its checksum verified (``PayloadError`` otherwise),
        up to :data:`FETCH_CONCURRENCY` at a time (the CRC-32 runs in threads: zlib releases the
        GIL, so objects are checked on several cores)."""
        refs = payload.objects
        if len(refs) == 1:
            return {refs[0].key: await self.read(refs[0])}
        if self.store.batch_reads:
            return await self._fetch_batches(refs)
        limit = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def one(ref: ObjectRef) -> memoryview:
            async with limit:
                return await self.read(ref)

        # gather, not a TaskGroup: on Python 3.11 a failing child can leave this task marked as
        # cancelling, which the take loop's cancellation check would then see
        results = await asyncio.gather(*(one(ref) for ref in refs), return_exceptions=True)
        return {ref.key: _result(value) for ref, value in zip(refs, results, strict=True)}

    async def _fetch_batches(self, refs: Sequence[ObjectRef]) -> dict[str, memoryview]:
        """:meth:`fetch` from a store with batch reads: the objects read in batches of about
        :data:`FETCH_BATCH_BYTES`, one batch at a time (one transfer stream: two at once only
        share it), each batch's objects checked in threads while the next is read."""
        batches: list[list[ObjectRef]] = [[]]
        held = 0
        for ref in refs:
            if batches[-1] and held + ref.size > FETCH_BATCH_BYTES:
                batches.append([])
                held = 0
            batches[-1].append(ref)
            held += ref.size
        checks: list[asyncio.Future[memoryview]] = []
        failed: PayloadError | None = None
        try:
            for batch in batches:
                buffers = await self.store.get_many([(ref.key, ref.size) for ref in batch])
                checks += [asyncio.ensure_future(self.check(ref, buffer)) for ref, buffer in zip(batch, buffers,
                                                                                                   strict=True)]
        except PayloadError as exc:
            failed = exc
        finally:
            # gather, not a TaskGroup (see fetch); every check awaited, even when a read failed
            results = await asyncio.gather(*checks, return_exceptions=True)
        out = {ref.key: _result(value) for ref, value in zip(refs, results, strict=False)}
        if failed is not None:
            raise failed
        return out

    async def read(self, ref: ObjectRef) -> memoryview:
        return await self.check(ref, await self.store.get(ref.key, ref.size))

    async def check(self, ref: ObjectRef, buffer: memoryview) -> memoryview:
        """``buffer`` read for ``ref``, its size and CRC-32 verified (``PayloadCorrupt``)."""
        if len(buffer) != ref.size:
            raise PayloadCorrupt(self.url, ref.key, f"{len(buffer)} bytes read, its entry says {ref.size}")
        crc = await asyncio.to_thread(zlib.crc32, buffer) if ref.size > 1 << 16 else zlib.crc32(buffer)
        if crc != ref.checksum:
            raise PayloadCorrupt(self.url, ref.key, f"CRC-32 {crc:#010x}, its entry says {ref.checksum:#010x}")
        return buffer

    async def stat(self, payload: GroupPayload) -> None:
        """Every object of ``payload`` is there with its size (``PayloadError`` otherwise): the
        cheap check (no read; the checksum is verified when the arrays are fetched)."""
        from ..errors import PayloadMissing

        for ref in payload.objects:
            size = await self.store.stat(ref.key)
            if size is None:
                raise PayloadMissing(self.url, ref.key, "not in the store")
            if size != ref.size:
                raise PayloadCorrupt(self.url, ref.key, f"holds {size} bytes, its entry says {ref.size}")

    async def free(self, rounds: int = 1) -> int:
        """Delete released objects from the store (``rounds`` steps of :data:`FREE_BATCH` sets);
        the number of objects confirmed gone. A set leaves the to-free ledger once all its keys
        are confirmed gone; a store error is logged and left for the next time."""
        total = 0
        for _ in range(rounds):
            members = await self.ledger.to_free(FREE_BATCH)
            if not members:
                break
            sets = {member: member_keys(member) for member in members}
            try:
                gone = set(await self.store.delete([key for keys in sets.values() for key in keys]))
            except PayloadError as exc:
                logger.warning("payload store %s: deleting released objects failed: %s", self.url, exc)
                break
            done = [member for member, keys in sets.items() if gone.issuperset(keys)]
            objects = sum(len(sets[member]) for member in done)
            await self.ledger.freed(done, objects)
            total += objects
            if len(done) < len(members):
                break  # some refused (a read lease): next time
            if len(members) < FREE_BATCH:
                break  # the ledger had no more (a set released since waits for the next call)
        return total

    async def sweep(self) -> int:
        """Free the objects whose intent passed its deadline unpublished; the number of object
        sets (groups) swept."""
        swept = await self.ledger.sweep(now_ms())
        if swept:
            logger.warning(
                "payload store %s: %d groups' objects put but never published (a producer died between put and "
                "publish?) swept", self.url, len(swept),
            )
            await self.free(rounds=1 + len(swept) // FREE_BATCH)
        return len(swept)

    async def reconcile(self, batch: int = FREE_BATCH) -> int:
        """The full sweep: list the namespace's objects in the store and free every one no ledger
        knows (its entry went without a fate script: an ``XDEL`` by hand, a lost stream); the
        number of object sets found. Costs a listing of the store: run rarely (the reclaim turn, every
        :data:`RECONCILE_INTERVAL_S`)."""
        found = 0
        listed: list[str] = []
        async for key, _ in self.store.list(self._prefix):
            listed.append(key)
            if len(listed) >= batch:
                found += await self.ledger.adopt_orphans(listed, now_ms())
                listed = []
        found += await self.ledger.adopt_orphans(listed, now_ms())
        if found:
            logger.warning(
                "payload store %s: %d object sets no entry refers to (removed by hand?) swept", self.url, found
            )
            await self.free(rounds=1 + found // FREE_BATCH)
        return found

    async def delete_all(self) -> int:
        """Delete every object of the namespace from the store (``rollstream ns delete``); the
        number the store confirmed gone."""
        gone = 0
        listed = [key async for key, _ in self.store.list(self._prefix)]
        for start in range(0, len(listed), FREE_BATCH):
            gone += len(await self.store.delete(listed[start : start + FREE_BATCH]))
        return gone

    async def offload_step(self, step: bytes, min_bytes: int) -> tuple[bytes, str]:
        """An episode journal's step as the journal keeps it: itself when shorter than
        ``min_bytes``, else put in the store (intent first) and replaced by a reference
        (:data:`STEP_REF` + ``key bytes crc32``); with JOURNAL_APPEND's ``objects`` ('' or 'key:bytes')."""
        if len(step) < min_bytes:
            return step, ""
        ref = ObjectRef(self.new_key(), len(step), zlib.crc32(step))
        await self.put([StoreObject(ref, [step])])
        return STEP_REF + f"{ref.key} {ref.size} {ref.checksum}".encode(), f"{ref.key}:{ref.size}"

    async def resolve_steps(self, steps: dict[int, list[bytes]]) -> dict[int, list[bytes]]:
        """A journal's steps with every reference read back from the store (checksum verified);
        ``PayloadError`` when one cannot be read."""
        out: dict[int, list[bytes]] = {}
        for member, values in steps.items():
            resolved = []
            for value in values:
                ref = step_ref(value)
                resolved.append(value if ref is None else bytes(await self.read(ref)))
            out[member] = resolved
        return out

    async def close(self) -> None:
        await self.store.close()
