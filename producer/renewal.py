"""Lease renewals that a stalled event loop cannot stop (issue 32, DESIGN §4.16).

A producer's prompts are pending entries it renews every third of the lease. Renewed from the
producer's own loop, one blocking rollout (a ``time.sleep(8)`` in a tool) stopped every renewal:
past the lease, another producer took over the *other* prompts in flight too and their groups
were generated twice (one discarded as a duplicate). :class:`Renewer` renews them from a thread
of its own, with its own event loop and its own Redis connection, so a blocking rollout costs its
own prompt's time and nothing else. The producer's loop only says which prompts it holds
(:meth:`Renewer.hold` / :meth:`Renewer.release`, under a lock) and hears back, on its own loop,
which leases were lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable

from rollstream.common.connection import Outage, connect
from rollstream.common.keys import Keys
from rollstream.common.loop_thread import LoopThread
from rollstream.common.protocol import PromptQueue

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT = 10.0
"""Seconds :meth:`Renewer.close` waits for the renewal thread's last turn."""


class Renewer:
    """Renews the held prompts' leases every ``interval`` seconds from its own thread; the ids
    found no longer owned are handed to ``on_lost`` on ``loop`` (the producer's), an error that
    is not a Redis outage (the namespace deleted, an ACL refusal) to ``on_error`` there."""

    def __init__(
        self,
        redis_url: str,
        keys: Keys,
        consumer: str,
        interval: float,
        on_lost: Callable[[list[bytes]], None],
        on_error: Callable[[BaseException], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.url = redis_url
        self.keys = keys
        self.consumer = consumer
        self.interval = interval
        self._on_lost = on_lost
        self._on_error = on_error
        self._loop = loop
        self._lock = threading.Lock()
        self._held: dict[bytes, str] = {}
        self._thread: LoopThread | None = None
        self._task: concurrent.futures.Future[None] | None = None
        self.turns = 0
        """Renewal turns that reached Redis (tests and the benchmark read it)."""

    # -- the producer's loop ------------------------------------------------------------

    def hold(self, stream: str, prompt_id: bytes) -> None:
        with self._lock:
            self._held[prompt_id] = stream

    def release(self, prompt_id: bytes) -> None:
        """Stop renewing ``prompt_id`` (before its last script: publish, dead letter, return)."""
        with self._lock:
            self._held.pop(prompt_id, None)

    def holds(self, prompt_id: bytes) -> bool:
        with self._lock:
            return prompt_id in self._held

    def start(self) -> None:
        if self._thread is None:
            self._thread = LoopThread(f"rollstream-renew-{self.consumer}")
            self._task = asyncio.run_coroutine_threadsafe(self._run(), self._thread.loop)

    def close(self) -> None:
        """Stop renewing and end the thread (blocking: call it off the producer's loop)."""
        thread, task = self._thread, self._task
        self._thread = self._task = None
        if thread is None or task is None:
            return
        task.cancel()
        with contextlib.suppress(BaseException):  # cancelled (the normal end), or an error already reported
            task.result(timeout=CLOSE_TIMEOUT)
        thread.close()

    # -- the renewal thread -------------------------------------------------------------

    async def _run(self) -> None:
        redis = connect(self.url, name=f"rollstream-producer-{self.consumer}-renew")
        prompts = PromptQueue(redis, self.keys, self.consumer)
        outage = Outage(logger, f"producer {self.consumer} (lease renewals)")

        async def turn() -> bool:
            await asyncio.sleep(self.interval)
            with self._lock:
                by_stream: dict[str, list[bytes]] = {}
                for pid, stream in self._held.items():
                    by_stream.setdefault(stream, []).append(pid)
            if not by_stream:
                return False
            lost: list[bytes] = []
            for stream, ids in by_stream.items():
                lost.extend(await prompts.renew(stream, ids))
            self.turns += 1
            if lost:
                with self._lock:
                    lost = [pid for pid in lost if self._held.pop(pid, None) is not None]
                if lost:
                    self._loop.call_soon_threadsafe(self._on_lost, lost)
            return True

        try:
            await outage.forever(turn)
        except Exception as exc:
            self._loop.call_soon_threadsafe(self._on_error, exc)
            raise
        finally:
            await redis.aclose()
