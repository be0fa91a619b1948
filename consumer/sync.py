"""``SyncGroupConsumer``: the consumer's API for trainers that are not asyncio."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollstream.common.config import PipelineConfig
from rollstream.common.loop_thread import LoopThread

from .batch import Batch
from .filters import KeepFilter
from .group_consumer import UNSET, GroupConsumer, Unset
from .options import ConsumerOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import ConsumerOptionArgs


class SyncGroupConsumer:
    """The same API for trainers that are not asyncio: its event loop runs in a daemon thread."""

    def __init__(
        self, url: str, namespace: str, name: str = "trainer-0", **options: Unpack[ConsumerOptionArgs]
    ) -> None:
        """The options of :meth:`GroupConsumer.connect` (:class:`ConsumerOptions`)."""
        opts = ConsumerOptions(**options)
        self._runner = LoopThread(f"rollstream-consumer-{name}")
        try:
            self._consumer: GroupConsumer = self._runner.run(GroupConsumer.open(url, namespace, name, opts))
        except BaseException:
            self._runner.close()
            raise

    @property
    def config(self) -> PipelineConfig:
        return self._consumer.config

    def take(
        self, target: int, *, max_staleness: int | Unset | None = UNSET, keep: KeepFilter | Unset | None = UNSET
    ) -> Batch:
        return self._runner.run(self._consumer.take(target, max_staleness=max_staleness, keep=keep))

    def commit(self, batch: Batch) -> int:
        return self._runner.run(self._consumer.commit(batch))

    def set_weight_version(self, version: int) -> None:
        self._runner.run(self._consumer.set_weight_version(version))

    def weight_version(self) -> int:
        return self._runner.run(self._consumer.weight_version())

    def pause(self) -> None:
        self._runner.run(self._consumer.pause())

    def resume(self, version: int | None = None) -> None:
        self._runner.run(self._consumer.resume(version))

    def close(self) -> None:
        try:
            self._runner.run(self._consumer.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> SyncGroupConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
