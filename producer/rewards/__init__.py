"""Reward functions: score the ``n`` samples of a group.

One package, one module per kind, one loader:

* :mod:`.base`: the interface (:class:`RewardFunction`: deadline, errors, validation);
* :mod:`.answers` (``math``), :mod:`.remote` (``remote:URL``), :mod:`.python` (``module:function``);
* :mod:`.loader`: :func:`load_reward`, which picks the kind by the spec's scheme; other layers
  add schemes with :func:`register_scheme` (:mod:`rollstream.integrations.framework_rewards` adds
  ``slime:``, ``slime-group:``, ``miles:``, ``miles-group:``).

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

``"slime:pkg.module.fn"``, ``"miles:..."`` (``-group`` for per group)
    A slime or miles reward function, called with the framework's ``Sample`` objects
    (:mod:`rollstream.integrations.framework_rewards`, registered when that module is imported).

``"module.path:function"`` or ``"path/to/file.py:function"``
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

from rollstream.common.errors import RewardBroken, RewardError

from .answers import MathReward, answers_match, extract_answer, math_reward
from .base import (
    DEFAULT_REWARD_TIMEOUT,
    REMOTE_ATTEMPTS,
    RETRY_AFTER_CAP,
    REWARD_THREADS,
    RewardFunction,
    validate_reward,
    validate_rewards,
)
from .loader import RewardLoader, Scheme, load_reward, register_scheme, schemes
from .python import PythonReward
from .remote import RemoteReward

__all__ = [
    "DEFAULT_REWARD_TIMEOUT",
    "REMOTE_ATTEMPTS",
    "RETRY_AFTER_CAP",
    "REWARD_THREADS",
    "MathReward",
    "PythonReward",
    "RemoteReward",
    "RewardBroken",
    "RewardError",
    "RewardFunction",
    "RewardLoader",
    "Scheme",
    "answers_match",
    "extract_answer",
    "load_reward",
    "math_reward",
    "register_scheme",
    "schemes",
    "validate_reward",
    "validate_rewards",
]
