"""Reward functions: score the ``n`` samples of a group.

A reward function is loaded from a spec string by :func:`load_reward`:

``"math"``
    Built-in verifier for math answers (:class:`MathReward`). The final answer is taken from the
    response: the last ``\\boxed{...}`` (nested braces handled), else the last final-answer phrase
    (``The answer is X``, ``Answer: X``, ``#### X``); no answer scores ``0.0``. It is compared with
    the label (int, float or str) numerically when both sides parse as numbers (``$``, thousands
    commas, spaces, a trailing ``.`` and ``%`` are ignored; ``\\frac{a}{b}``, ``a/b``, decimals and
    integers are compared as fractions, with a ``1e-6`` relative tolerance), else as normalised
    strings (case-insensitive, whitespace collapsed, ``\\text{...}`` unwrapped). A match scores
    ``1.0``, anything else ``0.0``. A missing label (``None``) raises :class:`RewardError`.

``"remote:URL"``
    A reward server (:class:`RemoteReward`), one HTTP request per group::

        POST URL
        Content-Type: application/json

        {"prompt": <str | list of chat messages>,
         "label": <the prompt's label, any JSON value>,
         "responses": ["<response text of sample 0>", "<sample 1>", ...],
         "samples": [{"index": 0, "status": "completed", "finish_reason": "stop",
                      "response_length": 42, "metadata": {...}}, ...],
         "metadata": {<group metadata, {} when not given>}}

    The server answers ``200`` with ``{"rewards": [r0, r1, ...]}``: exactly one reward per
    response, in the same order, each a finite number or an object mapping names to finite
    numbers (put the scalar training reward under ``"score"``, which is what
    :attr:`Sample.scalar_reward` reads). Connection errors, timeouts, ``429`` and ``5xx`` are
    retried (3 attempts in all, exponential backoff, ``Retry-After`` honoured up to 10 s); any
    other status, a body that is not such an object, or the last failed attempt raises
    :class:`RewardError`. ``timeout`` is the per-request HTTP timeout.

``"module.path:function"``
    A Python callable (:class:`PythonReward`); ``function`` may be a dotted attribute path
    (``pkg.mod:Class.method``). The calling convention is decided once, at load time:

    * **per group** when the callable has an attribute ``per_group`` set to ``True``, or, without
      that attribute, when its first positional parameter is named ``samples``:
      ``fn(samples: list[Sample], prompt, label) -> list[Reward]`` (one reward per sample, in
      order);
    * **per sample** otherwise (or when ``per_group = False``):
      ``fn(sample: Sample, prompt, label) -> Reward``.

    Both sync and async callables work (an awaitable result is awaited). Async per-sample
    functions score the samples of a group concurrently. Sync ones never run on the event loop:
    each group's call (all its samples, in order) runs in a daemon thread, at most ``threads``
    at once. A thread cannot be stopped: one still running past the deadline is counted as
    stuck, and when ``max_stuck`` are stuck at once, :meth:`score` raises :class:`RewardBroken`
    (the producer stops with a fatal error instead of leaking threads).

Every kind gets a **deadline**: ``score()`` raises :class:`RewardError` when one call takes
longer than ``deadline`` seconds (``load_reward(timeout=...)``, the producer's
``--reward-timeout``, default :data:`DEFAULT_REWARD_TIMEOUT`).

A :class:`Reward` is a finite ``float`` (ints are converted; ``bool`` is refused) or a
``dict[str, float]``. :meth:`RewardFunction.score` validates what it gets and raises
:class:`RewardError` (chained to the cause) for anything unusable, including any exception raised
by a user function, ``SystemExit``, ``KeyboardInterrupt`` and a ``CancelledError`` the function
raised itself included; a cancellation of the caller is never swallowed. The producer assigns
the returned rewards to ``sample.reward``, or fails the samples with the error (one bad prompt
costs one failed group, see :mod:`rollstream.producer.rollout`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import json
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any
from urllib.parse import urlsplit

import httpx
from rollstream.common.backoff import Backoff
from rollstream.common.cancellation import being_cancelled
from rollstream.common.errors import ConfigError, RewardError
from rollstream.common.imports import import_callable
from rollstream.common.models import PromptContent, Reward, Sample

logger = logging.getLogger(__name__)

RETRY_AFTER_CAP = 10.0
"""Seconds: the longest ``Retry-After`` honoured, and the longest backoff between attempts."""
REMOTE_ATTEMPTS = 3
"""Attempts of a remote reward request (connection errors, timeouts, 429, 5xx)."""
DEFAULT_REWARD_TIMEOUT = 300.0
"""Seconds one ``score()`` call (one group) may take by default; generous on purpose."""
REWARD_THREADS = 4
"""Sync Python rewards: groups scored in threads at once."""

__all__ = [
    "DEFAULT_REWARD_TIMEOUT",
    "MathReward",
    "PythonReward",
    "RemoteReward",
    "RewardBroken",
    "RewardFunction",
    "answers_match",
    "extract_answer",
    "load_reward",
    "math_reward",
    "validate_reward",
    "validate_rewards",
]


# --------------------------------------------------------------------------------------------
# Interface and validation
# --------------------------------------------------------------------------------------------


class RewardBroken(RewardError):
    """The reward function cannot be used any more (not one prompt's problem): fatal."""


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


# --------------------------------------------------------------------------------------------
# "math": answer extraction and comparison
# --------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_PHRASE = re.compile(r"####|\banswer\s*(?:is\b|:)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.;!?](?=\s|$)|,\s")
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_VARIABLE_PREFIX = re.compile(r"^[a-z]\w*\s*=\s*(?=\S)", re.IGNORECASE)
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?", re.IGNORECASE)
_RATIO = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))/([+-]?(?:\d+(?:\.\d*)?|\.\d+))")
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"([+-]?)\\frac(\d)(\d)")
_LEADING_NUMBER = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_MAX_NUMBER_CHARS = 200


def _boxed_content(text: str, start: int) -> str | None:
    """The argument of a ``\\boxed`` ending at ``start``: ``{...}`` (balanced) or one token."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    depth = 0
    j = i
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None  # unbalanced: the response was cut inside the box


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None: last ``\\boxed{}``, else last answer phrase."""
    if not isinstance(text, str) or not text:
        return None
    for match in reversed(list(_BOXED.finditer(text))):
        content = _boxed_content(text, match.end())
        if content is not None and content.strip():
            return content.strip()
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if not phrases:
        return None
    rest = text[phrases[-1].end() :]
    lines = [line.strip(" \t*_:") for line in rest.split("\n")]
    # "The answer is:\n42" -> the next non-empty line
    candidate = next((line for line in lines if line), "")
    cut = _SENTENCE_END.search(candidate)
    if cut is not None:
        candidate = candidate[: cut.start()]
    candidate = candidate.strip(" \t*_")
    return candidate or None


def _normalize_text(value: str) -> str:
    s = value.replace("\u2212", "-")
    previous = None
    while previous != s:
        previous = s
        s = _TEXT_WRAPPER.sub(r"\1", s)
    for old, new in (
        ("\\$", ""),
        ("$", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", " "),
        ("\\left", ""),
        ("\\right", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\%", "%"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\u00b0", ""),
    ):
        s = s.replace(old, new)
    s = " ".join(s.split()).strip()
    while s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _boxed_content(s, 0) == s[1:-1]:
        s = s[1:-1].strip()
    return s.lower()


def _parse_number(value: str) -> Fraction | None:
    """A normalised answer as an exact fraction, or None when it is not a plain number."""
    s = _VARIABLE_PREFIX.sub("", value).replace(" ", "")
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    if s.endswith("%"):
        s = s[:-1]
    frac = _FRAC.fullmatch(s) or _FRAC_SHORT.fullmatch(s)
    if frac is not None:
        numerator = _parse_number(frac.group(2))
        denominator = _parse_number(frac.group(3))
        if numerator is None or denominator is None or denominator == 0:
            return None
        result = numerator / denominator
        return -result if frac.group(1) == "-" else result
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    try:
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        ratio = _RATIO.fullmatch(s)
        if ratio is not None:
            denominator_value = Fraction(ratio.group(2))
            if denominator_value == 0:
                return None
            return Fraction(ratio.group(1)) / denominator_value
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _answer_number(normalised: str) -> Fraction | None:
    number = _parse_number(normalised)
    if number is not None:
        return number
    # "42 apples", "5 cm": a leading number followed by words without any digit
    leading = _LEADING_NUMBER.match(normalised)
    if leading is not None and not re.search(r"\d", normalised[leading.end() :]):
        return _parse_number(leading.group(0))
    return None


def _numbers_close(a: Fraction, b: Fraction) -> bool:
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    except OverflowError:
        return False


def _label_text(label: Any) -> str:
    if isinstance(label, bool):
        return str(label)
    if isinstance(label, numbers.Integral):
        return str(int(label))
    if isinstance(label, numbers.Real):
        return repr(float(label))
    text = str(label)
    if "\\boxed" in text or "####" in text:  # a full reference solution: take its answer
        text = extract_answer(text) or text
    return text


def answers_match(answer: str, label: Any) -> bool:
    """Whether an extracted answer equals the label (numerically, else as normalised text)."""
    if label is None:
        return False
    norm_answer = _normalize_text(answer)
    if isinstance(label, numbers.Real) and not isinstance(label, bool):
        if isinstance(label, float) and not math.isfinite(label):
            return False
        label_number: Fraction | None = (
            Fraction(int(label)) if isinstance(label, numbers.Integral) else Fraction(float(label))
        )
        norm_label = _normalize_text(_label_text(label))
    else:
        norm_label = _normalize_text(_label_text(label))
        label_number = _answer_number(norm_label)
    answer_number = _answer_number(norm_answer)
    if answer_number is not None and label_number is not None:
        return _numbers_close(answer_number, label_number)
    return norm_answer == norm_label


def math_reward(response: str, label: Any) -> float:
    """1.0 when the final answer of ``response`` matches ``label``, else 0.0."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, label) else 0.0


class MathReward(RewardFunction):
    """The ``"math"`` reward: :func:`math_reward` of every sample's response."""

    name = "math"

    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> list[Reward]:
        if label is None:
            raise RewardError("the math reward needs a label, but the prompt has none")
        return [math_reward(sample.response, label) for sample in samples]


# --------------------------------------------------------------------------------------------
# "remote:URL"
# --------------------------------------------------------------------------------------------


class RemoteReward(RewardFunction):
    """A reward server, one POST per group (protocol in the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        attempts: int = 3,
        backoff: float = 0.5,
        max_connections: int = 64,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"remote reward URL must be http(s)://host[:port]/path, got {url!r}")
        if attempts < 1:
            raise ConfigError(f"attempts must be at least 1, got {attempts!r}")
        self.url = url
        self.name = f"remote:{url}"
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff
        self.max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    def _get_client(self) -> httpx.AsyncClient:
        # created lazily so that it belongs to the event loop that uses it
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
                limits=httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=min(self.max_connections, 16),
                ),
            )
        return self._client

    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> list[Any]:
        body = {
            "prompt": prompt,
            "label": label,
            "responses": [sample.response for sample in samples],
            "samples": [
                {
                    "index": sample.index,
                    "status": str(sample.status),
                    "finish_reason": sample.finish_reason,
                    "response_length": sample.response_length,
                    "metadata": sample.metadata,
                }
                for sample in samples
            ],
            "metadata": dict(metadata),
        }
        try:
            content = json.dumps(body).encode()
        except (TypeError, ValueError) as exc:
            raise RewardError(f"reward request for {self.url} is not JSON-serialisable: {exc}") from exc
        reply = await self._post(content)
        if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
            raise RewardError(
                f"reward server {self.url} answered {_short(reply)}, expected {{'rewards': [...]}}"
            )
        rewards: list[Any] = reply["rewards"]
        if len(rewards) != len(samples):
            raise RewardError(
                f"reward server {self.url} returned {len(rewards)} rewards for {len(samples)} samples"
            )
        return rewards

    async def _post(self, content: bytes) -> Any:
        client = self._get_client()
        last_error = ""
        backoff = Backoff(base=self.backoff, cap=max(self.backoff, RETRY_AFTER_CAP))
        for attempt in range(1, self.attempts + 1):
            delay = backoff.delay(attempt - 1)
            try:
                response = await client.post(
                    self.url, content=content, headers={"Content-Type": "application/json"}
                )
            except httpx.TransportError as exc:  # connection refused/reset, timeouts
                last_error = _describe(exc)
            else:
                status = response.status_code
                if status == 429 or status >= 500:
                    last_error = f"HTTP {status}: {response.text[:200]}"
                    retry_after = _retry_after(response)
                    if retry_after is not None:
                        delay = retry_after
                elif not 200 <= status < 300:
                    raise RewardError(
                        f"reward server {self.url} rejected the request with HTTP {status}: "
                        f"{response.text[:500]}"
                    )
                else:
                    try:
                        return response.json()
                    except ValueError as exc:
                        raise RewardError(
                            f"reward server {self.url} answered with invalid JSON: "
                            f"{response.text[:200]!r}"
                        ) from exc
            if attempt < self.attempts:
                await asyncio.sleep(delay)
        raise RewardError(
            f"reward server {self.url} failed after {self.attempts} attempts: {last_error}"
        )

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP) if math.isfinite(seconds) else None


# --------------------------------------------------------------------------------------------
# "module.path:function"
# --------------------------------------------------------------------------------------------


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


def _import_callable(spec: str) -> Callable[..., Any]:
    if not spec.partition(":")[0].strip() or not spec.partition(":")[2].strip():
        raise ConfigError(
            f"reward spec {spec!r} must look like 'module.path:function' (or be 'math' or 'remote:URL')"
        )
    return import_callable(spec, "reward spec")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_reward(spec: str, *, timeout: float = DEFAULT_REWARD_TIMEOUT) -> RewardFunction:
    """Build the reward function named by ``spec``: ``"math"``, ``"remote:URL"`` or
    ``"module.path:function"``. Raises ConfigError for a bad spec, an unknown module, a missing
    attribute or a non-callable. ``timeout`` (seconds) is the deadline of each ``score()`` call
    of any kind; a remote reward's HTTP requests get a share of it (one per attempt)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"reward spec must be 'math', 'remote:URL' or 'module.path:function', got {spec!r}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError(f"reward timeout must be a positive number of seconds, got {timeout!r}")
    spec = spec.strip()
    reward: RewardFunction
    if spec == "math":
        reward = MathReward()
        reward.deadline = float(timeout)
        return reward
    if spec.startswith("remote:"):
        url = spec[len("remote:") :].strip()
        if not url:
            raise ConfigError("reward spec 'remote:' needs a URL, e.g. 'remote:http://host:8000/reward'")
        remote = RemoteReward(url, timeout=float(timeout) / REMOTE_ATTEMPTS, attempts=REMOTE_ATTEMPTS)
        remote.deadline = float(timeout)
        return remote
    if ":" not in spec:
        raise ConfigError(
            f"unknown reward spec {spec!r}: expected 'math', 'remote:URL' or 'module.path:function'"
        )
    fn = _import_callable(spec)
    return PythonReward(fn, name=spec, timeout=float(timeout))

