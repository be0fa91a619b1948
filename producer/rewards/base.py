"""The reward interface (:class:`RewardFunction`) and the validation every reward's result goes through."""

from __future__ import annotations

import abc
import asyncio
import math
import numbers
from collections.abc import Mapping
from typing import Any

from rollstream.common.cancellation import being_cancelled
from rollstream.common.errors import RewardError
from rollstream.common.models import PromptContent, Reward, Sample

RETRY_AFTER_CAP = 10.0
"""Seconds: the longest ``Retry-After`` honoured, and the longest backoff between attempts."""
REMOTE_ATTEMPTS = 3
"""Attempts of a remote reward request (connection errors, timeouts, 429, 5xx)."""
DEFAULT_REWARD_TIMEOUT = 300.0
"""Seconds one ``score()`` call (one group) may take by default; generous on purpose."""
REWARD_THREADS = 4
"""Sync Python rewards: groups scored in threads at once."""


class RewardFunction(abc.ABC):
    """Scores the samples of one group; subclasses implement :meth:`_score`.

    :meth:`score` wraps :meth:`_score`: it bounds it by :attr:`deadline`, turns every exception
    into :class:`RewardError` (re-raising the caller's own cancellation) and validates the result.
    """

    name: str
    deadline: float | None = None
    """Seconds one :meth:`score` call may take; None: no bound."""

    async def score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[Reward]:
        """One reward per sample, in order. ``metadata`` is the group's (remote rewards send it)."""
        if not samples:
            return []
        deadline = asyncio.timeout(self.deadline)
        try:
            async with deadline:
                result = await self._score(prompt, label, samples, metadata or {})
        except RewardError:
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: one prompt's problem too
            if isinstance(exc, asyncio.CancelledError) and being_cancelled():
                raise
            if isinstance(exc, TimeoutError) and deadline.expired():
                raise RewardError(f"reward {self.name!r} timed out after {self.deadline:g} s") from exc
            raise RewardError(f"reward {self.name!r} failed: {_describe(exc)}") from exc
        return validate_rewards(result, len(samples), f"reward {self.name!r}")

    @abc.abstractmethod
    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> Any:
        """Return the raw rewards (validated by :meth:`score`)."""

    async def aclose(self) -> None:
        """Release resources (HTTP clients); the function must not be used afterwards."""
        return None

    async def __aenter__(self) -> RewardFunction:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def validate_reward(value: Any, where: str = "reward") -> Reward:
    """Return ``value`` as a finite float or a ``dict[str, float]``; RewardError otherwise."""
    if isinstance(value, bool):
        raise RewardError(f"{where} is a bool ({value!r}): return a number or a dict of numbers")
    if isinstance(value, numbers.Real):
        return _finite(value, where)
    if isinstance(value, Mapping):
        if not value:
            raise RewardError(f"{where} is an empty dict: a dict reward needs at least one entry")
        out: dict[str, float] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise RewardError(f"{where} has a non-string key {key!r}")
            if isinstance(item, bool) or not isinstance(item, numbers.Real):
                raise RewardError(
                    f"{where}[{key!r}] is {type(item).__name__} ({item!r}), expected a number"
                )
            out[key] = _finite(item, f"{where}[{key!r}]")
        return out
    raise RewardError(
        f"{where} is {type(value).__name__} ({_short(value)}), "
        "expected a finite number or a dict of finite numbers"
    )


def _finite(value: numbers.Real, where: str) -> float:
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError) as exc:
        raise RewardError(f"{where} ({_short(value)}) cannot be converted to float") from exc
    if not math.isfinite(number):
        raise RewardError(f"{where} is not finite ({number!r})")
    return number


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate_rewards(result: Any, n: int, source: str = "reward") -> list[Reward]:
    """Check that ``result`` is a list/tuple of ``n`` valid rewards and return them normalised."""
    if not isinstance(result, list | tuple):
        raise RewardError(
            f"{source} returned {type(result).__name__} ({_short(result)}), "
            f"expected a list of {n} rewards"
        )
    if len(result) != n:
        raise RewardError(f"{source} returned {len(result)} rewards for {n} samples")
    return [validate_reward(value, f"{source}: reward {i}") for i, value in enumerate(result)]
