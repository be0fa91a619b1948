"""The namespace's mix inside ``take()``: each source's quota of a batch, and who has run dry.

Quotas are :func:`~rollstream.common.mix.apportion` of the target by the weights of the live
sources, plus each one's carry from the groups committed since the set of live sources last
changed (the baseline in the ``sources`` hash, written here), so the long-run ratio is exact to
the group and survives trainer restarts. A source is dry when its feeder finished it (``done``)
and none of its prompts is alive any more (fed + requeued - lost - committed, minus what this
call already holds of it): it leaves the mix with a WARNING and the others take its share.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from redis.asyncio import Redis
from rollstream.common.connection import Outage
from rollstream.common.keys import Keys, SourceField
from rollstream.common.mix import apportion, carries
from rollstream.common.protocol import Sources
from rollstream.common.redis_values import int_or


class Mixer:
    def __init__(
        self, redis: Redis, keys: Keys, weights: Mapping[str, float], outage: Outage,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self.log = log
        self.sources = Sources(redis, keys)
        self.keys = keys
        self.weights = dict(weights)
        self._outage = outage
        self._left: set[str] = set()
        self._last: dict[str, str] = {}

    async def _state(self) -> dict[str, str]:
        self._last = await self._outage.run(self.sources.state)
        return self._last

    def unfed(self, quotas: Mapping[str, int], taken: Counter[str]) -> str:
        """Why a waiting take lacks groups of a source, when it is because nothing of that source
        is fed or alive (no feeder feeds it: a mix changed under the feeder, say); "" otherwise.
        From the state the last :meth:`quotas` read."""
        state = self._last
        short = []
        for name, quota in sorted(quotas.items()):
            if taken[name] >= quota or state.get(SourceField.of(name, "done")) == "1":
                continue
            fed = self._count(state, name, "fed")
            alive = (fed + self._count(state, name, "requeued") - self._count(state, name, "lost")
                     - self._count(state, name, "committed") - taken[name])
            if alive <= 0:
                short.append(f"{name!r} ({taken[name]} of its {quota} taken, {fed} fed ever, none alive)")
        if not short:
            return ""
        return (f"source(s) {', '.join(short)} of the mix have nothing fed to generate: is a feeder feeding "
                "them? (rollstream feed NAME=PATH ... with every source of the mix)")

    @staticmethod
    def _count(state: Mapping[str, str], name: str, kind: str) -> int:
        return int_or(state.get(SourceField.of(name, kind)), 0)

    async def quotas(self, target: int, held: Counter[str] | None = None) -> dict[str, int]:
        """Each live source's share of a batch of ``target`` (``held``: groups of each source this
        call already holds, not counted as alive elsewhere)."""
        state = await self._state()
        held = held or Counter()
        live: dict[str, float] = {}
        for name, weight in self.weights.items():
            alive = (
                self._count(state, name, "fed") + self._count(state, name, "requeued")
                - self._count(state, name, "lost") - self._count(state, name, "committed") - held[name]
            )
            if state.get(SourceField.of(name, "done")) == "1" and alive <= 0:
                if name not in self._left:
                    self._left.add(name)
                    self.log.warning(
                        "source %r ran dry (fed to the end, nothing of it alive): it leaves the mix, the others "
                        "take its share", name,
                    )
                continue
            live[name] = weight
        if not live:  # everything dry: whatever still arrives is taken as it comes
            return {name: target for name in self.weights}
        live_set = ",".join(sorted(live))
        if state.get(SourceField.BASE_SET) != live_set:
            mapping: dict[str, str | int] = {SourceField.BASE_SET: live_set}
            for name in self.weights:
                mapping[SourceField.base(name)] = self._count(state, name, "committed")
            await self._outage.run(lambda: self.sources.set(mapping))
            for name in self.weights:
                state[SourceField.base(name)] = str(mapping[SourceField.base(name)])
        since = {
            name: self._count(state, name, "committed") - int_or(state.get(SourceField.base(name)), 0) for name in live
        }
        return apportion(target, live, carries(live, since))
