"""What ``GroupConsumer.connect()`` returns: awaitable, or an async context manager."""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .group_consumer import GroupConsumer


class Connecting:
    """What ``GroupConsumer.connect()`` returns: await it for the consumer, or use it as an
    async context manager that closes the consumer on exit."""

    def __init__(self, opening: Coroutine[Any, Any, GroupConsumer]) -> None:
        self._opening: Coroutine[Any, Any, GroupConsumer] | None = opening
        self._consumer: GroupConsumer | None = None

    def _take(self) -> Coroutine[Any, Any, GroupConsumer]:
        if self._opening is None:
            raise RuntimeError("GroupConsumer.connect(...) can be awaited or entered only once")
        opening, self._opening = self._opening, None
        return opening

    def __await__(self) -> Generator[Any, None, GroupConsumer]:
        return self._take().__await__()

    async def __aenter__(self) -> GroupConsumer:
        self._consumer = await self._take()
        return self._consumer

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._consumer is not None:
            await self._consumer.aclose()

    def __del__(self) -> None:
        if self._opening is not None:  # never awaited: close the coroutine without a warning
            self._opening.close()
