"""The one reward loader: ``--reward SPEC`` -> a :class:`~.base.RewardFunction`, by scheme.

A spec is ``scheme:rest`` for a registered scheme (``remote:URL``; ``slime:`` / ``miles:`` and
their ``-group`` forms once :mod:`rollstream.integrations.framework_rewards` is imported, as the CLI does),
a registered bare name (``math``), else a Python callable (``module.path:function`` or
``path/to/file.py:function``, :func:`rollstream.common.imports.import_callable`).

Schemes are registered, not imported: the producer layer never imports the integrations (the
layering of docs/architecture.md), so a layer above registers its own with
:func:`register_scheme` when it is imported. A new scheme is one ``register_scheme`` call next to
the reward class it builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollstream.common.checked import is_number
from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_callable

from .answers import MathReward
from .base import DEFAULT_REWARD_TIMEOUT, REMOTE_ATTEMPTS, RewardFunction
from .python import PythonReward
from .remote import RemoteReward

RewardLoader = Callable[[str, float], RewardFunction]
"""``loader(spec, timeout)``: the reward named by the whole (stripped) ``spec``; ``timeout`` is
the deadline of each ``score()`` call, in seconds. Raises ConfigError for a bad spec."""


@dataclass(frozen=True, slots=True)
class Scheme:
    name: str
    load: RewardLoader
    usage: str
    """How the spec looks, for error messages: ``remote:URL``."""
    bare: bool = False
    """The spec is the name alone (``math``), not ``name:rest``."""


_SCHEMES: dict[str, Scheme] = {}


def register_scheme(name: str, load: RewardLoader, *, usage: str, bare: bool = False) -> None:
    """Make ``name:...`` (``bare``: ``name`` alone) a reward spec that ``load`` builds. A scheme
    shadows a Python module of the same name (``slime:pkg.fn`` is never module ``slime``)."""
    if not name or not name.replace("-", "_").isidentifier():
        raise ConfigError(f"reward scheme name {name!r} must be a word (letters, digits, '-', '_')")
    _SCHEMES[name] = Scheme(name, load, usage, bare)


def schemes() -> dict[str, Scheme]:
    """The registered schemes, by name (a copy)."""
    return dict(_SCHEMES)


def _usages() -> str:
    return ", ".join(f"'{s.usage}'" for s in _SCHEMES.values())


def load_reward(spec: str, *, timeout: float = DEFAULT_REWARD_TIMEOUT) -> RewardFunction:
    """Build the reward function named by ``spec`` (module docstring). Raises ConfigError for a
    bad spec, an unknown module, a missing attribute or a non-callable. ``timeout`` (seconds) is
    the deadline of each ``score()`` call of any kind; a remote reward's HTTP requests get a
    share of it (one per attempt)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"reward spec must be {_usages()} or 'module.path:function', got {spec!r}")
    if not is_number(timeout) or not timeout > 0:
        raise ConfigError(f"reward timeout must be a positive number of seconds, got {timeout!r}")
    spec = spec.strip()
    name, sep, _ = spec.partition(":")
    scheme = _SCHEMES.get(name.strip())
    if scheme is not None and bool(sep) != scheme.bare:
        return scheme.load(spec, float(timeout))
    if not sep:
        raise ConfigError(f"unknown reward spec {spec!r}: expected {_usages()} or 'module.path:function'")
    fn = import_callable(spec, "reward spec")
    return PythonReward(fn, name=spec, timeout=float(timeout))


def _math(spec: str, timeout: float) -> RewardFunction:
    reward = MathReward()
    reward.deadline = timeout
    return reward


def _remote(spec: str, timeout: float) -> RewardFunction:
    url = spec.partition(":")[2].strip()
    if not url:
        raise ConfigError("reward spec 'remote:' needs a URL, e.g. 'remote:http://host:8000/reward'")
    remote = RemoteReward(url, timeout=timeout / REMOTE_ATTEMPTS, attempts=REMOTE_ATTEMPTS)
    remote.deadline = timeout
    return remote


register_scheme("math", _math, usage="math", bare=True)
register_scheme("remote", _remote, usage="remote:URL")
