"""The trainer's side of the bias ledger (:mod:`rollstream.common.bias`): the batch's ``bias/...``
metrics and the WARNING when a bucket's trained share falls below its fed share."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping

from rollstream.common import bias
from rollstream.common.logs import Prefixed
from rollstream.common.models import Group

logger = logging.getLogger("rollstream.consumer.group_consumer")
"""The consumer's logger: the warning comes from ``take()``."""


class BiasWatch:
    """Per consumer: reads the ledger ``take()`` got, warns at most every ``interval`` seconds
    per bucket, and names the fields of epochs no longer kept (dropped with the next commit)."""

    def __init__(self, name: str, namespace: str, interval: float) -> None:
        self.name = name
        self.namespace = namespace
        self.log = Prefixed(logger, "consumer", name, namespace)
        self.interval = interval
        self.forget: list[str] = []
        """Ledger fields of old epochs, deleted with the next commit's counts."""
        self._warned: dict[str, float] = {}
        self._epoch: int | None = None

    def observe(self, groups: list[Group], fields: Mapping[str, int], trained: Counter[str]) -> dict[str, float]:
        """The batch's ``bias/...`` metrics: the ledger of the newest epoch in the batch, this
        batch counted as trained; logs the under-trained buckets."""
        if not groups:
            return {}
        epoch = max(g.epoch for g in groups)
        mine = f"{bias.PREFIX}{epoch}:"
        merged = Counter({k: v for k, v in fields.items() if k.startswith(mine)})
        merged.update({k: v for k, v in trained.items() if k.startswith(mine)})
        dimensions = bias.ledger(merged).get(epoch, {})
        if epoch != self._epoch:  # a new epoch: the fields of the ones no longer kept go with the next commit
            self._epoch = epoch
            self.forget = bias.old_fields(fields, epoch)
        now = time.monotonic()
        for line in bias.short_buckets(epoch, dimensions):
            key = line.split(": trained share", 1)[0]
            if now - self._warned.get(key, -self.interval) >= self.interval:
                self._warned[key] = now
                self.log.warning(
                    "the trainer does not see the dataset: %s", line
                )
        return bias.metrics(epoch, dimensions)
