"""``module.path:function`` (or ``file.py:function``): a Python callable, per sample or per group."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from rollstream.common.cancellation import being_cancelled
from rollstream.common.errors import ConfigError, RewardBroken, RewardError
from rollstream.common.models import PromptContent, Reward, Sample

from .base import DEFAULT_REWARD_TIMEOUT, REWARD_THREADS, RewardFunction, _describe, validate_reward

logger = logging.getLogger(__name__)


def _is_per_group(fn: Callable[..., Any]) -> bool:
    flag = getattr(fn, "per_group", None)
    if isinstance(flag, bool):
        return flag
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return bool(positional) and positional[0].name == "samples"


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - callable objects with an async __call__
    )


class PythonReward(RewardFunction):
    """A Python callable, called per sample or per group (rule in the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        timeout: float | None = DEFAULT_REWARD_TIMEOUT,
        per_group: bool | None = None,
        threads: int = REWARD_THREADS,
        max_stuck: int | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"reward function must be callable, got {type(fn).__name__}")
        if threads < 1:
            raise ConfigError(f"reward threads must be at least 1, got {threads!r}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        self.deadline = timeout
        self.per_group = _is_per_group(fn) if per_group is None else per_group
        self.concurrent = _is_async(fn)
        self.max_stuck = threads if max_stuck is None else max_stuck
        self._slots = asyncio.Semaphore(threads)
        """Held from a thread's start until its end is seen on the loop: at most ``threads`` run."""
        self._stuck: set[threading.Thread] = set()
        """Threads of calls that outlived their deadline and are still running."""
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        try:
            signature.bind(None, None, None)
        except TypeError as exc:
            shape = "(samples, prompt, label)" if self.per_group else "(sample, prompt, label)"
            raise ConfigError(
                f"reward function {self.name!r} cannot be called as {shape}: {exc}"
            ) from exc

    async def _call(self, first: Any, prompt: PromptContent, label: Any) -> Any:
        result = self.fn(first, prompt, label)
        if inspect.isawaitable(result):
            result = await result
        return result

    @property
    def stuck(self) -> int:
        """Sync calls still running past their deadline (their threads cannot be stopped)."""
        self._stuck = {t for t in self._stuck if t.is_alive()}
        return len(self._stuck)

    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> Any:
        if not self.concurrent:
            result = await self._in_thread(self._sync_group, list(samples), prompt, label)
            if inspect.isawaitable(result):
                result = await result
            if self.per_group:
                return result
            rewards = []
            for sample, value in zip(samples, result, strict=True):
                if inspect.isawaitable(value):
                    value = await value
                rewards.append(validate_reward(value, f"reward {self.name!r}: sample {sample.index}"))
            return rewards
        if self.per_group:
            return await self._call(list(samples), prompt, label)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._per_sample(sample, prompt, label))
                    for sample in samples
                ]
        except BaseExceptionGroup as eg:
            first = eg.exceptions[0]
            if isinstance(first, Exception):
                raise first  # noqa: B904 - keeps its own __cause__ (the user's exception)
            raise
        return [task.result() for task in tasks]

    async def _per_sample(self, sample: Sample, prompt: PromptContent, label: Any) -> Reward:
        try:
            result = await self._call(sample, prompt, label)
        except RewardError:
            raise
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and being_cancelled():
                raise
            raise RewardError(
                f"reward {self.name!r} failed on sample {sample.index}: {_describe(exc)}"
            ) from exc
        return validate_reward(result, f"reward {self.name!r}: sample {sample.index}")

    def _sync_group(self, samples: list[Sample], prompt: PromptContent, label: Any) -> Any:
        """A sync function over one group (in a reward thread): per group, or per sample in order."""
        if self.per_group:
            return self.fn(samples, prompt, label)
        results = []
        for sample in samples:
            try:
                results.append(self.fn(sample, prompt, label))
            except BaseException as exc:
                raise RewardError(
                    f"reward {self.name!r} failed on sample {sample.index}: {_describe(exc)}"
                ) from exc
        return results

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a daemon thread (a stuck one never blocks the process's exit), at
        most ``threads`` at once; a call cancelled by the deadline leaves its thread running,
        counted in :attr:`stuck`."""
        if self.stuck >= self.max_stuck:
            raise RewardBroken(
                f"reward {self.name!r}: {self.stuck} calls are still running past the "
                f"{self.deadline:g} s deadline (threads cannot be stopped); the reward function hangs"
            )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        await self._slots.acquire()

        def finish(result: Any, error: BaseException | None) -> None:  # on the loop
            self._slots.release()
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def target() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting task, which wraps it
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(finish, result, error)

        thread = threading.Thread(target=target, name=f"reward-{self.name}", daemon=True)
        try:
            thread.start()
        except BaseException:
            self._slots.release()
            raise
        try:
            return await done
        except asyncio.CancelledError:
            if thread.is_alive():
                self._stuck.add(thread)
                logger.warning(
                    "reward %r: a call outlived its deadline and its thread cannot be stopped "
                    "(%d stuck, %d allowed)", self.name, self.stuck, self.max_stuck,
                )
            raise
