"""Warm pools: a generate function's ``prepare(info)`` hook, run for a prompt's episodes before
they start (a sandbox, a container, a browser), its result handed to the episode, an unused one
released.

A generate function opts in with attributes (as with ``aclose``)::

    async def generate(episode):
        sandbox = await episode.prepared()      # prepare's result for this episode (awaited if still running)
        ...

    async def prepare(info: EpisodeInfo) -> Sandbox: ...   # one call per episode (group member)
    async def release(sandbox: Sandbox) -> None: ...       # optional: for a result no episode took

    generate.prepare = prepare
    generate.release = release

The producer calls ``prepare`` as soon as it admits the prompt; with ``rollstream produce --warm K``
it admits up to K prompts beyond its concurrency, whose ``prepare`` runs while they wait for
room, so their sandboxes are ready when their episodes start (rllm's warm queue, along the
admission order). A result is released when its episode ends without having called
``episode.prepared()``, or when the prompt goes back unrun (a drain, a lost lease, a fatal
error); a ``prepare`` still running then is cancelled. A ``prepare`` that raised makes
``episode.prepared()`` raise (the sample fails, as any exception in the function).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.common.errors import ConfigError

from .episode import EpisodeInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmHooks:
    prepare: Callable[[EpisodeInfo], Any]
    release: Callable[[Any], Any] | None


def warm_hooks(fn: Any) -> WarmHooks | None:
    """The ``prepare`` / ``release`` attributes of a generate function, or None."""
    prepare = getattr(fn, "prepare", None)
    if prepare is None:
        return None
    release = getattr(fn, "release", None)
    if not callable(prepare) or (release is not None and not callable(release)):
        raise ConfigError("a generate function's prepare and release attributes must be callables")
    return WarmHooks(prepare, release)


async def _call(fn: Callable[..., Any], arg: Any) -> Any:
    result = fn(arg)
    return await result if inspect.isawaitable(result) else result


class Prepared:
    """One prompt's prepared resources, one per episode (member), started at once."""

    def __init__(self, hooks: WarmHooks, infos: Sequence[EpisodeInfo]) -> None:
        self.hooks = hooks
        self.tasks = [asyncio.create_task(_call(hooks.prepare, info), name=f"prepare-{info.index}-{info.member}")
                      for info in infos]
        self.used: set[int] = set()
        self.released: set[int] = set()

    async def get(self, member: int) -> Any:
        """Member ``member``'s result (its episode took it: it will not be released)."""
        self.used.add(member)
        return await self.tasks[member]

    async def release_unused(self, members: Iterable[int] | None = None) -> int:
        """Release the results no episode took (cancel a ``prepare`` still running); how many."""
        count = 0
        for member in range(len(self.tasks)) if members is None else members:
            if member in self.used or member in self.released:
                continue
            self.released.add(member)
            task = self.tasks[member]
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                continue
            if task.cancelled() or task.exception() is not None:
                continue
            count += 1
            if self.hooks.release is not None:
                try:
                    await _call(self.hooks.release, task.result())
                except Exception as exc:  # the user's cleanup failed: logged, never fatal
                    logger.warning("releasing a prepared resource (member %d) failed: %s: %s",
                                   member, type(exc).__name__, exc)
        return count
