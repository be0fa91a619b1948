"""Lease renewals that a stalled event loop cannot stop (issue 32, DESIGN §4.16).

A producer's prompts are pending entries it renews every third of the lease. Renewed from the
producer's own loop, one blocking rollout (a ``time.sleep(8)`` in a tool) stopped every renewal:
past the lease, another producer took over the *other* prompts in flight too and their groups
were generated twice (one discarded as a duplicate). :class:`Renewer` renews them from a thread
of its own, with its own event loop and its own Redis connection, so a blocking rollout costs its
own prompt's time and nothing else. The producer's loop only says which prompts it holds
(:meth:`Renewer.hold` / :meth:`Renewer.release`, under a lock) and hears back, on its own loop,
which leases were lost.

A prompt stays held until its last script (publish, dead letter, return) has returned: the loop
can stall between the call and the script being sent. Likewise, while the loop claims prompts
(ADMIT, XAUTOCLAIM, adopting its own: :meth:`Renewer.claiming`), the script may have run in
Redis while the loop, stalled, has not read its reply: for that while every entry pending under
the producer's name is renewed, not only the held ones. Outside it only held prompts are renewed,
so an entry whose ADMIT reply was lost with a connection is still reclaimed after the lease.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from rollstream.common.connection import Outage, connect
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.loop_thread import LoopThread
from rollstream.common.protocol import PromptQueue

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT = 10.0
"""Seconds :meth:`Renewer.close` waits for the renewal thread's last turn."""
LOGGED_IDS = 32
"""Ids a renewal's debug line names at most."""


def _ids(by_stream: dict[str, list[bytes]]) -> str:
    ids = [pid.decode() for pids in by_stream.values() for pid in pids]
    more = f" (+{len(ids) - LOGGED_IDS} more)" if len(ids) > LOGGED_IDS else ""
    return " ".join(ids[:LOGGED_IDS]) + more


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
        self.log = Prefixed(logger, "producer", consumer, keys.namespace)
        self.interval = interval
        self._on_lost = on_lost
        self._on_error = on_error
        self._loop = loop
        self._lock = threading.Lock()
        self._held: dict[bytes, str] = {}
        self._claiming = 0
        self._thread: LoopThread | None = None
        self._task: asyncio.Task[None] | None = None
        """The renewal loop, a task of the thread's loop."""

    # -- the producer's loop ------------------------------------------------------------

    def hold(self, stream: str, prompt_id: bytes) -> None:
        with self._lock:
            self._held[prompt_id] = stream

    def release(self, prompt_id: bytes) -> None:
        """Stop renewing ``prompt_id`` (once its last script returned: publish, dead letter, return)."""
        with self._lock:
            self._held.pop(prompt_id, None)

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Around a call that makes prompts pending under this producer's name, until they are
        held: meanwhile every entry pending under the name is renewed."""
        with self._lock:
            self._claiming += 1
        try:
            yield
        finally:
            with self._lock:
                self._claiming -= 1

    def start(self) -> None:
        if self._thread is None:
            self._thread = LoopThread(f"rollstream-renew-{self.consumer}")
            self._thread.run(self._spawn())

    def close(self) -> None:
        """Stop renewing and end the thread once its loop has ended (blocking: call it off the
        producer's loop)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with contextlib.suppress(concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(self._cancel(), thread.loop).result(CLOSE_TIMEOUT)
        thread.close()

    async def _spawn(self) -> None:
        self._task = asyncio.create_task(self._run(), name="renew")

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=CLOSE_TIMEOUT)

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
                claiming = self._claiming > 0
            if claiming:  # claimed, perhaps not yet known to the stalled loop
                for stream in prompts.streams:
                    known = set(by_stream.get(stream, ()))
                    extra = [pid for pid in await prompts.own_pending_ids(stream) if pid not in known]
                    if extra:
                        by_stream.setdefault(stream, []).extend(extra)
            if not by_stream:
                return claiming
            lost: list[bytes] = []
            for stream, ids in by_stream.items():
                lost.extend(await prompts.renew(stream, ids))
            if self.log.isEnabledFor(logging.DEBUG):  # which ones: a take-over is checked against it
                self.log.debug(
                    "renewed %d leases (%d lost%s): %s", sum(map(len, by_stream.values())), len(lost),
                    ", claiming" if claiming else "", _ids(by_stream),
                )
            if lost:
                with self._lock:
                    lost = [pid for pid in lost if self._held.pop(pid, None) is not None]
                if lost:
                    self._loop.call_soon_threadsafe(self._on_lost, lost)
            return True

        try:
            await outage.forever(turn)
        except Exception as exc:
            with contextlib.suppress(RuntimeError):  # the producer's loop already closed
                self._loop.call_soon_threadsafe(self._on_error, exc)
            raise
        finally:
            await redis.aclose()
