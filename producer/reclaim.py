"""Reclaim: prompts idle past the lease (their producer died) taken over, and the prompts pending
under this producer's own name adopted when it starts (a restart with the same ``--name``).

Looking for idle prompts walks the whole pending list, so one producer per interval does it for
the fleet (``reclaim_turn``) and, when it finds some, records when (``announce_reclaim``): every
producer sees it at its next turn and reclaims what it has room for. With P producers the looks
cost P times less than one per producer (docs/scale.md). While some are due, the worker's
admission holds off (:attr:`Reclaimer.due`), so the next free capacity goes to them: a dead
producer's prompts do not wait behind new ones. On Redis 6.2 deleted entries come back without
fields; they are acknowledged and skipped. The turn also sweeps orphan episode journals, a bounded
SCAN step at a time (:meth:`Reclaimer.sweep_journals`), and the payload store's orphans and
released objects (:meth:`Reclaimer.sweep_payload`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Protocol

from rollstream.common.config import PipelineConfig
from rollstream.common.errors import PayloadError
from rollstream.common.events import now_ms
from rollstream.common.logs import Prefixed
from rollstream.common.payload.plane import RECONCILE_INTERVAL_S, PayloadPlane
from rollstream.common.protocol import Admitted, Control, EpisodeJournals, PromptQueue

from .capacity import Work, WorkTable
from .settings import ProducerSettings

JOURNAL_SWEEP_COUNT = 100
"""Keys one sweep step SCANs (its COUNT): the sweep's cost per reclaim turn is bounded."""


class Reclaiming(Protocol):
    """What the reclaim pass reads of its producer (:class:`~.worker.Producer`): public members only."""

    @property
    def table(self) -> WorkTable: ...
    @property
    def config(self) -> PipelineConfig: ...
    @property
    def settings(self) -> ProducerSettings: ...
    @property
    def log(self) -> Prefixed: ...
    @property
    def prompts(self) -> PromptQueue: ...
    @property
    def control(self) -> Control: ...
    @property
    def journals(self) -> EpisodeJournals: ...
    @property
    def plane(self) -> PayloadPlane | None: ...
    @property
    def payload_stats(self) -> dict[str, int]: ...


class Reclaimer:
    """The reclaim pass of one :class:`~.worker.Producer`: its loop, and the take-over it shares
    with the adoption at start. It runs on the producer's :class:`~.capacity.WorkTable`
    (capacity, prompts held, outage)."""

    def __init__(self, producer: Reclaiming) -> None:
        self.producer = producer
        self.due = False
        """Idle prompts were found (here or by another producer) and not all taken over yet."""
        self.seen_ms = 0
        """The newest ``reclaim_due_ms`` this producer acted on (0 at start: its first turn acts on
        an earlier find once, harmlessly: XAUTOCLAIM finds nothing left)."""
        self.reconciled = time.monotonic()
        """When this producer last listed the payload store against the ledgers (not at start)."""

    def leases_lost(self, lost: list[bytes]) -> None:
        """The renewal thread found prompts no longer ours (taken over after the lease: another
        producer's reclaim); called on the producer's loop."""
        p = self.producer
        for pid in lost:
            work = p.table.get(pid)
            if work is not None and not work.lease_lost and not work.finishing:
                work.lease_lost = True
                p.log.warning(
                    "lost the lease of prompt entry %s (taken over after %.0f s idle)",
                    pid.decode(), p.config.lease_seconds,
                )

    async def loop(self) -> None:
        """Take over prompts idle past the lease, one :meth:`turn` after another."""

        def give_up() -> None:
            self.due = False

        await self.producer.table.outage.forever(self.turn, on_error=give_up)

    async def turn(self) -> bool:
        p, table = self.producer, self.producer.table
        n = p.config.n_samples_per_prompt
        interval = p.settings.reclaim_interval or min(5.0, p.config.lease_seconds / 4)
        lease_ms = int(p.config.lease_seconds * 1000)
        if not self.due:
            await asyncio.sleep(interval)
        if table.stopping.is_set():
            self.due = False
            return False
        if not self.due:
            my_turn, found_ms = await p.prompts.reclaim_turn(int(interval * 900))
            if my_turn:
                await self.sweep_journals()
                await self.sweep_payload()
            if found_ms > self.seen_ms:  # another producer found idle prompts
                self.seen_ms = found_ms
                self.due = True
            elif not my_turn:
                return False
        if await p.control.paused():
            self.due = False
            return False
        if not self.due:
            if not await p.prompts.any_idle(lease_ms):
                return False
            self.due = True
            await p.prompts.announce_reclaim()
            self.seen_ms = now_ms()  # its own find: already acting on it
        await table.capacity.room(n, table.stopping)
        with table.claiming():
            claimed = await p.prompts.reclaim(lease_ms, count=table.capacity.free // n, held=table)
            table.outage.recovered()  # before the take-over, whose own calls ride out an outage
            if claimed:
                p.log.info(
                    "reclaimed %d prompts idle past the %.0f s lease",
                    len(claimed), p.config.lease_seconds,
                )
                await self.take_over(claimed)
        if not claimed and p.prompts.reclaim_scanned:
            self.due = False  # scanned to the end: nothing left to take over
        if not self.due:
            table.wake()
        return False  # the outage ended above

    async def sweep_journals(self) -> None:
        """The fleet's turn also sweeps a bounded step of orphan episode journals (their prompt
        ended some other way than a publish or a dead letter by a producer: an operator's XDEL,
        a 6.2 XAUTOCLAIM of a deleted entry); a journal whose prompt waits or runs stays."""
        p = self.producer
        swept = await p.journals.sweep(JOURNAL_SWEEP_COUNT)
        if swept:
            p.log.info("swept %d episode journals whose prompt is in no prompt stream", swept)

    async def sweep_payload(self) -> None:
        """The fleet's turn also frees payload objects: those whose intent passed its deadline
        unpublished (a producer killed between put and publish), and those the fate scripts
        released that no trainer commit freed yet. A store error is logged, never fatal."""
        p = self.producer
        if p.plane is None:
            return
        try:
            p.payload_stats["orphans_swept"] += await p.plane.sweep()
            await p.plane.free(rounds=4)
            if time.monotonic() - self.reconciled >= RECONCILE_INTERVAL_S:
                self.reconciled = time.monotonic()
                p.payload_stats["orphans_swept"] += await p.plane.reconcile()
        except PayloadError as exc:
            p.log.warning("payload sweep: %s", exc)

    async def adopt_own_pending(self) -> None:
        """Prompts pending under this name (a restart with the same ``--name``) are ours now."""
        p, table = self.producer, self.producer.table
        with table.claiming():
            claimed = await table.outage.run(p.prompts.own_pending)
            if claimed:
                p.log.info("adopting %d prompts pending under its name", len(claimed))
                await self.take_over(claimed)

    async def take_over(self, claimed: list[Admitted]) -> None:
        p, table = self.producer, self.producer.table
        n = p.config.n_samples_per_prompt
        version = await table.outage.run(p.control.weight_version)
        for item in claimed:
            if not item.fields:
                await table.outage.run(functools.partial(p.prompts.ack_deleted, item.stream, item.entry_id))
                continue
            if item.entry_id in table:
                continue
            if item.previous is not None:  # which prompt, whose, how long idle: a take-over is rare and loud
                p.log.info(
                    "taking over prompt entry %s of %s (%s)",
                    item.entry_id.decode(), item.stream, item.previous.describe(),
                )
            if not await table.capacity.take(n, table.stopping):
                # Stopping: no room will come. Listed without a task, the shutdown hands it back.
                table.hold(Work(stream=item.stream, prompt_id=item.entry_id, fields=item.fields, version=version))
                continue
            table.reclaimed += 1
            table.start(item, version, n)
            # Only a counter, but a Redis outage here must not become a fatal error.
            await table.outage.run(p.prompts.count_reclaimed)
