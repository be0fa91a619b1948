"""An asyncio event loop in a daemon thread, for synchronous callers of the async API.

``SyncGroupConsumer`` and the slime/miles glue need one: their callers are synchronous (often
inside someone else's running loop, where ``asyncio.run`` is refused), and the consumer's own
tasks (the name lease) must go on between calls.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """:meth:`run` blocks the calling thread on a coroutine run by the loop of this thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the calling thread: stop the call too
            raise

    def close(self) -> None:
        """Stop the loop and close it once its thread has ended (idempotent)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
